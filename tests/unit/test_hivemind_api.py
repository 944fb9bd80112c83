"""hivemind enters swarm/ through one module (swarm.net.hivemind_api), so an upgrade of hivemind touches one file.
That a peer imports it only as its DHT starts is tests/unit/test_startup.py's."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[2]


def _imports_hivemind(tree: ast.AST) -> list[ast.stmt]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "hivemind" for a in node.names):
            found.append(node)
        elif isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "hivemind":
            found.append(node)
    return found


def test_only_the_adapter_imports_hivemind_in_swarm() -> None:
    users = {
        p.relative_to(ROOT).as_posix()
        for p in sorted((ROOT / "swarm").rglob("*.py"))
        if _imports_hivemind(ast.parse(p.read_text()))
    }
    assert users == {"swarm/net/hivemind_api.py"}


def test_the_adapter_names_hivemind_objects() -> None:
    import hivemind

    from swarm.net import hivemind_api

    assert hivemind_api.DHT is hivemind.DHT
    assert all(getattr(hivemind_api, name) is not None for name in hivemind_api.__all__)
