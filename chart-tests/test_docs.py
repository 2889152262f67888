"""docs/troubleshooting.md covers every reason the checks, conditions and Events emit."""

from __future__ import annotations

import re

import pytest

from conftest import ROOT

TROUBLESHOOTING = (ROOT / "docs" / "troubleshooting.md").read_text()


def rust_consts(path: str, module: str) -> set[str]:
    """String values of `pub const X: &str = "…";` inside `pub mod <module> { … }`."""
    text = (ROOT / path).read_text()
    m = re.search(r"pub mod " + module + r"\s*\{(.*?)\n\}", text, re.S)
    assert m, f"{path}: no module {module}"
    return set(re.findall(r'pub const \w+: &str = "([A-Za-z0-9]+)";', m.group(1)))


def documented_check_reasons() -> set[str]:
    """First-column reasons of the tables in docs/checks.md."""
    text = (ROOT / "docs" / "checks.md").read_text()
    return set(re.findall(r"^\| `([A-Z][A-Za-z0-9]+)` \|", text, re.M))


SOURCES = {
    "CacheBackend condition reasons": rust_consts("shared/src/crd/cache_backend.rs", "backend_reason"),
    "CacheBackend condition types": rust_consts("shared/src/crd/cache_backend.rs", "backend_condition"),
    "CacheNode condition types": rust_consts("shared/src/crd/cache_node.rs", "node_condition"),
    "node check reasons (docs/checks.md)": documented_check_reasons(),
    "node plan issue reasons": rust_consts("controller/src/reconcile/nodes/plans.rs", "issue"),
}
_events = ROOT / "controller" / "src" / "reconcile" / "cachebackend" / "events.rs"
if _events.exists():
    SOURCES["Events"] = rust_consts("controller/src/reconcile/cachebackend/events.rs", "reason")


@pytest.mark.parametrize("what", sorted(SOURCES))
def test_every_reason_is_in_troubleshooting(what: str) -> None:
    names = SOURCES[what]
    assert names, what
    if "types" in what:  # condition types head table rows, unquoted
        missing = sorted(n for n in names if not re.search(rf"\b{n}\b", TROUBLESHOOTING))
    else:
        missing = sorted(n for n in names if f"`{n}`" not in TROUBLESHOOTING)
    assert missing == [], f"docs/troubleshooting.md does not cover these {what}: {missing}"
