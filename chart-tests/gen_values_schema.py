#!/usr/bin/env python3
"""Generate chart/values.schema.json from chart/values.yaml.

The schema follows the defaults' shapes (an object with keys is closed: a misspelt key is an error
at `helm install`), plus two annotations in the comments above a key:

    # -- Text              the key's description (continued on the following `#` lines)
    # @schema {...}        JSON Schema keywords merged into the key's schema

An object whose annotation sets `additionalProperties` is free-form (Kubernetes pass-through
blocks such as resources or affinity, and string maps such as labels); an empty `{}` default
without one is a free-form object. Integers under a `ports` block or named `*port` are limited to
1-65535.

Usage: gen_values_schema.py            print the schema
       gen_values_schema.py --write    write chart/values.schema.json
       gen_values_schema.py --check    exit 1 when chart/values.schema.json differs
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
VALUES = ROOT / "chart" / "values.yaml"
SCHEMA = ROOT / "chart" / "values.schema.json"

KEY_LINE = re.compile(r"^(\s*)([A-Za-z0-9_.\-/]+):(\s|$)")

Path_ = tuple[str, ...]


def parse_annotations(text: str) -> dict[Path_, dict[str, Any]]:
    """Map each key path of a block mapping to its `# --` description and `# @schema` keywords."""
    out: dict[Path_, dict[str, Any]] = {}
    stack: list[tuple[int, str]] = []
    desc: list[str] | None = None
    extra: dict[str, Any] = {}

    def reset() -> None:
        nonlocal desc, extra
        desc, extra = None, {}

    for lineno, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if not stripped:
            reset()
            continue
        if stripped.startswith("#"):
            body = stripped[1:]
            body = body[1:] if body.startswith(" ") else body
            if body.startswith("-- "):
                desc = [body[3:].strip()]
            elif body.startswith("@schema "):
                try:
                    kw = json.loads(body[len("@schema ") :])
                except json.JSONDecodeError as e:
                    raise SystemExit(f"{VALUES}:{lineno}: bad @schema JSON: {e}") from e
                if not isinstance(kw, dict):
                    raise SystemExit(f"{VALUES}:{lineno}: @schema must be a JSON object")
                extra.update(kw)
            elif desc is not None and body:
                desc.append(body.strip())
            continue
        m = KEY_LINE.match(line)
        if not m or stripped.startswith("-"):
            reset()
            continue
        indent, key = len(m.group(1)), m.group(2)
        while stack and stack[-1][0] >= indent:
            stack.pop()
        path = tuple(k for _, k in stack) + (key,)
        ann: dict[str, Any] = {}
        if desc:
            ann["description"] = " ".join(desc)
        if extra:
            ann["schema"] = extra
        if ann:
            out[path] = ann
        stack.append((indent, key))
        reset()
    return out


def is_port(path: Path_) -> bool:
    return "ports" in path[:-1] or path[-1].lower().endswith("port")


def schema_for(value: Any, path: Path_, ann: dict[Path_, dict[str, Any]]) -> dict[str, Any]:
    a = ann.get(path, {})
    extra: dict[str, Any] = dict(a.get("schema", {}))
    node: dict[str, Any] = {}
    if isinstance(value, dict):
        if "additionalProperties" in extra or not value:
            node["type"] = "object"
        else:
            node["type"] = "object"
            node["additionalProperties"] = False
            node["properties"] = {
                k: schema_for(v, path + (str(k),), ann) for k, v in value.items()
            }
    elif isinstance(value, bool):
        node["type"] = "boolean"
    elif isinstance(value, int):
        node["type"] = "integer"
        if is_port(path):
            node["minimum"], node["maximum"] = 1, 65535
    elif isinstance(value, float):
        node["type"] = "number"
    elif isinstance(value, str):
        node["type"] = "string"
    elif isinstance(value, list):
        node["type"] = "array"
    if "description" in a:
        node = {"description": a["description"], **node}
    node.update(extra)
    return node


def generate() -> str:
    text = VALUES.read_text()
    values = yaml.safe_load(text)
    ann = parse_annotations(text)
    root = schema_for(values, (), ann)
    root["properties"] = {"global": {"type": "object"}, **root["properties"]}
    schema = {
        "$schema": "http://json-schema.org/draft-07/schema#",
        "title": "inference-cache chart values",
        "description": "Generated from chart/values.yaml by chart-tests/gen_values_schema.py; "
        "do not edit by hand.",
        **root,
    }
    return json.dumps(schema, indent=2, ensure_ascii=False) + "\n"


def main(argv: list[str]) -> int:
    out = generate()
    if "--write" in argv:
        if not SCHEMA.exists() or SCHEMA.read_text() != out:
            SCHEMA.write_text(out)
            print(f"wrote {SCHEMA.relative_to(ROOT)}")
        return 0
    if "--check" in argv:
        if not SCHEMA.exists() or SCHEMA.read_text() != out:
            print(f"{SCHEMA.relative_to(ROOT)} is stale: run scripts/chart-tests.sh --regen")
            return 1
        return 0
    sys.stdout.write(out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
