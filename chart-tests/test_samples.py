"""Custom resources in config/samples/ are valid against the CRDs' openAPIV3Schema, checked the way
the API server does with strict field validation (an unknown field is an error)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from conftest import ROOT, crd_objects

SAMPLES = sorted((ROOT / "config" / "samples").glob("*.yaml"))


def _strict(schema: dict[str, Any]) -> dict[str, Any]:
    """OpenAPI v3 structural schema -> JSON Schema that rejects unknown fields (the API server's
    `fieldValidation=Strict`, kubectl's default) and knows int-or-string."""
    s = copy.deepcopy(schema)

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if node.get("x-kubernetes-int-or-string") and "type" not in node and "anyOf" not in node:
                node["anyOf"] = [{"type": "integer"}, {"type": "string"}]
            if node.get("nullable") and "type" in node:
                t = node["type"]
                node["type"] = [t, "null"] if isinstance(t, str) else list(t) + ["null"]
            if (
                "properties" in node
                and "additionalProperties" not in node
                and not node.get("x-kubernetes-preserve-unknown-fields")
            ):
                node["additionalProperties"] = False
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(s)
    props = s.setdefault("properties", {})
    props.setdefault("apiVersion", {"type": "string"})
    props.setdefault("kind", {"type": "string"})
    props.setdefault("metadata", {"type": "object"})
    return s


def _schemas() -> dict[tuple[str, str], dict[str, Any]]:
    out = {}
    for crd in crd_objects():
        group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
        for v in crd["spec"]["versions"]:
            out[(f"{group}/{v['name']}", kind)] = _strict(v["schema"]["openAPIV3Schema"])
    return out


SCHEMAS = _schemas()


def _docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def test_there_are_samples() -> None:
    assert len(SAMPLES) >= 5


@pytest.mark.parametrize("path", SAMPLES, ids=[p.name for p in SAMPLES])
def test_sample_is_valid(path: Path) -> None:
    for doc in _docs(path):
        key = (doc["apiVersion"], doc["kind"])
        assert key in SCHEMAS, f"{path.name}: no CRD serves {key}"
        jsonschema.validate(doc, SCHEMAS[key])


@pytest.mark.parametrize("path", SAMPLES[:1], ids=[p.name for p in SAMPLES[:1]])
def test_unknown_field_is_rejected(path: Path) -> None:
    doc = _docs(path)[0]
    doc["spec"]["replicaz"] = 1
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(doc, SCHEMAS[(doc["apiVersion"], doc["kind"])])
