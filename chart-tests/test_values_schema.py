"""chart/values.schema.json is generated from values.yaml and rejects what it should."""

from __future__ import annotations

import helm_python as helm
import pytest

import gen_chart_readme
import gen_values_schema
from conftest import CHART_DIR, load_chart


def test_values_schema_is_up_to_date() -> None:
    """Drift: regenerate with `scripts/chart-tests.sh --regen`."""
    current = (CHART_DIR / "values.schema.json").read_text()
    assert current == gen_values_schema.generate(), (
        "chart/values.schema.json is stale: run scripts/chart-tests.sh --regen"
    )


def test_every_value_is_documented() -> None:
    """Each leaf value and each free-form block in values.yaml has a `# --` description."""
    import yaml

    text = gen_values_schema.VALUES.read_text()
    values = yaml.safe_load(text)
    ann = gen_values_schema.parse_annotations(text)
    missing = []

    def walk(v, path):
        a = ann.get(path, {})
        if isinstance(v, dict) and v and "additionalProperties" not in a.get("schema", {}):
            for k, child in v.items():
                walk(child, path + (k,))
        elif "description" not in a:
            missing.append(".".join(path))

    walk(values, ())
    assert missing == []


def test_defaults_pass_the_schema() -> None:
    load_chart().validate_schema({})


@pytest.mark.parametrize(
    "values",
    [
        {"controller": {"replica": 2}},  # misspelt key
        {"webhook": {"certMode": "vault"}},  # not an enum value
        {"controller": {"ports": {"grpc": 70000}}},  # port out of range
        {"agent": {"ports": {"http": "9090"}}},  # port as a string
        {"logFormat": "text"},
        {"controller": {"replicas": 0}},
        {"controller": {"image": {"digest": "latest"}}},
        {"agent": {"gpu": {"nodeAffinity": {"values": []}}}},
        {"auth": {"tokenExpirationSeconds": 60}},  # below the kubelet's 10-minute minimum
        {"webhook": {"pod": {"timeoutSeconds": 31}}},
        {"agent": {"hostNetwork": "yes"}},
        {"modelCache": {"featureGates": "CachingSupport=yes"}},  # not a boolean
        {"modelCache": {"featureGates": {"CachingSupport": "on"}}},
        {"modelCache": {"featureGates": 3}},
        {"modelCache": {"idlePeriodSeconds": 0}},
        {"modelCache": {"controlNamespace": "Model_Cache"}},  # not a DNS label
        {"modelCache": {"enabled": "true"}},
        {"kvEventSubscriber": {"images": "x"}},
    ],
)
def test_schema_rejects(values: dict) -> None:
    with pytest.raises(helm.HelmValuesError):
        load_chart().validate_schema(values)


@pytest.mark.parametrize(
    "values",
    [
        {"agent": {"maxUnavailable": 1}},
        {"controller": {"pdb": {"maxUnavailable": "50%"}}},
        {"agent": {"tolerations": [{"operator": "Exists"}]}},
        {"controller": {"resources": {"requests": {"cpu": "1"}}}},
        {"imagePullSecrets": [{"name": "regcred"}]},
        {"global": {"imageRegistry": "x"}},
        {"modelCache": {"featureGates": "CachingSupport=true,ModelCacheEncryption=true"}},
        {"modelCache": {"featureGates": {"SomeFutureGate": True}}},
        {"modelCache": {"controlNamespace": "caches", "createControlNamespace": False}},
    ],
)
def test_schema_accepts(values: dict) -> None:
    load_chart().validate_schema(values)


def test_chart_readme_is_up_to_date() -> None:
    """chart/README.md's values table is generated from values.yaml (helm-docs conventions)."""
    current = (CHART_DIR / "README.md").read_text()
    assert current == gen_chart_readme.generate(), (
        "chart/README.md is stale: run scripts/chart-tests.sh --regen"
    )


def test_chart_readme_lists_every_value_with_its_default() -> None:
    rows = gen_chart_readme.rows()
    keys = {r.split(" | ")[0].removeprefix("| ") for r in rows}
    for key in ("controller.replicas", "agent.gpu.driverRoot", "agent.extraVolumes",
                "monitoring.prometheusRule.enabled", "controller.resources"):
        assert key in keys, key
    (replicas,) = [r for r in rows if r.startswith("| controller.replicas |")]
    assert "| int | `2` |" in replicas
