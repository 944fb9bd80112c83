"""The import contract: swarm's layers import only the layers below them, peer/ and coordinator/ sit on
swarm below its app layer, and no module reaches itself through its imports. Read from the source with
``ast`` (nothing is imported); imports inside functions count like top-level ones.

Layers, lowest first: config <- core <- train <- net <- control <- app. control needs neither net nor
train. swarm.v1 (generated protobuf) is for net, control, app, peer and coordinator. Only app imports
peer/ and coordinator/; peer/ and coordinator/ are separate processes and do not import each other.
"""

from __future__ import annotations

import ast
import gc
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(30)

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("swarm", "peer", "coordinator")

_BELOW_APP = {"swarm.config", "swarm.core", "swarm.train", "swarm.net", "swarm.control", "swarm.v1"}
# unit -> the other units it may import (a unit may always import itself and the bare `swarm` package)
ALLOWED: dict[str, set[str]] = {
    "swarm.config": set(),
    "swarm.core": {"swarm.config"},
    "swarm.train": {"swarm.config", "swarm.core"},
    "swarm.net": {"swarm.config", "swarm.core", "swarm.train", "swarm.v1"},
    "swarm.control": {"swarm.config", "swarm.core", "swarm.v1"},
    "swarm.app": _BELOW_APP | {"peer", "coordinator"},
    "swarm.v1": set(),
    "peer": _BELOW_APP,
    "coordinator": _BELOW_APP,
}
# unit -> third-party top-level packages it must not import
FORBIDDEN_THIRD_PARTY: dict[str, set[str]] = {
    "swarm.config": {"hivemind"},
    "swarm.core": {"hivemind"},
    "swarm.train": {"hivemind"},
}


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def read_sources(root: Path = ROOT) -> dict[str, str]:
    """Module name -> source text of every module under swarm/, peer/ and coordinator/."""
    return {module_name(p, root): p.read_text() for package in PACKAGES for p in sorted((root / package).rglob("*.py"))}


def _parse(source: str) -> ast.AST:
    """``ast.parse`` with the garbage collector held off: CPython 3.11 raises "AST constructor recursion depth
    mismatch" when a collection runs finalizers (an earlier test's abandoned asyncio tasks logging) mid-parse."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        return ast.parse(source)
    finally:
        if enabled:
            gc.enable()


def imported_modules(source: str, me: str, is_package: bool, known: set[str]) -> set[str]:
    """Every module ``me`` imports, anywhere in its body, as dotted names: known modules resolved to
    the longest known prefix, anything else to its top-level package."""
    package = me if is_package else me.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(_parse(source)):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(up + ([base] if base else []))
            targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
        else:
            continue
        for target in targets:
            parts = target.split(".")
            prefixes = [".".join(parts[:k]) for k in range(len(parts), 0, -1)]
            found.add(next((p for p in prefixes if p in known), parts[0]))
    # `from pkg import mod` names both; keep the module (importing it imports its package anyway)
    return {m for m in found if not any(o.startswith(m + ".") for o in found)} - {me}


def import_graph(sources: dict[str, str]) -> dict[str, set[str]]:
    known = set(sources)
    packages = {m for m in known if any(other.startswith(m + ".") for other in known)}
    return {m: imported_modules(src, m, m in packages, known) for m, src in sources.items()}


def unit(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "swarm" and len(parts) > 1 else parts[0]


def violations(graph: dict[str, set[str]]) -> list[str]:
    """One line per import that breaks the layer order, and per module outside a known unit."""
    found = []
    for module, targets in sorted(graph.items()):
        mine = unit(module)
        if module != "swarm" and mine not in ALLOWED:
            found.append(f"{module} is in no layer; add {mine} to ALLOWED in tests/unit/test_layers.py")
            continue
        for target in sorted(targets):
            theirs = unit(target)
            if target in graph:
                if theirs not in ALLOWED.get(mine, set()) | {mine, "swarm"}:
                    found.append(f"{module} imports {target} ({mine} may not import {theirs})")
            elif theirs in FORBIDDEN_THIRD_PARTY.get(mine, set()):
                found.append(f"{module} imports {target} ({mine} may not import {theirs})")
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles among the modules of ``graph``, one example path per strongly connected set."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan; the graphs here are small enough for recursion
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_example_path(graph, set(c)) for c in components]


def _example_path(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    start = min(component)
    path, seen = [start], {start}
    while True:
        nxt = min(w for w in graph[path[-1]] if w in component)
        if nxt in seen:
            return path[path.index(nxt) :] + [nxt]
        path.append(nxt)
        seen.add(nxt)


# ---- the tree ---------------------------------------------------------------------------------------


def test_every_import_follows_the_layer_order():
    graph = import_graph(read_sources())
    assert {unit(m) for m in graph} - {"swarm"} == set(ALLOWED), "a layer is missing from the checkout or the table"
    assert violations(graph) == []


def test_there_are_no_import_cycles():
    assert [" -> ".join(c) for c in cycles(import_graph(read_sources()))] == []


# ---- the checker itself -----------------------------------------------------------------------------


def test_the_checker_catches_upward_and_lazy_imports_and_hivemind_below_net():
    graph = import_graph(
        {
            "swarm": "",
            "swarm.core": "",
            "swarm.core.math": "def f():\n    from swarm.net.bulk.transport import Transport\n",
            "swarm.train": "",
            "swarm.train.model.model": "import hivemind\nfrom ...core import math\n",
            "swarm.net": "",
            "swarm.net.bulk.transport": "from swarm.core.math import f\n",
            "swarm.control": "",
            "swarm.control.client": "from swarm.net.bulk import transport\n",
            "peer": "",
            "peer.daemon": "from swarm.app import cli\n",
            "swarm.app": "",
            "swarm.app.cli": "import peer.daemon\n",
            "swarm.extra": "",
        }
    )
    assert graph["swarm.train.model.model"] == {"hivemind", "swarm.core.math"}  # relative import resolved
    assert violations(graph) == [
        "peer.daemon imports swarm.app.cli (peer may not import swarm.app)",
        "swarm.control.client imports swarm.net.bulk.transport (swarm.control may not import swarm.net)",
        "swarm.core.math imports swarm.net.bulk.transport (swarm.core may not import swarm.net)",
        "swarm.extra is in no layer; add swarm.extra to ALLOWED in tests/unit/test_layers.py",
        "swarm.train.model.model imports hivemind (swarm.train may not import hivemind)",
    ]
    assert sorted(cycles(graph)) == [
        ["peer.daemon", "swarm.app.cli", "peer.daemon"],
        ["swarm.core.math", "swarm.net.bulk.transport", "swarm.core.math"],  # through a lazy import
    ]
