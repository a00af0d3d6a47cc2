"""No import circles: no module of polyamp/, compat/ or backends/ imports one that imports it back.

Imports are read from the source with ``ast``, at every level (inside functions too, where a
circle hides from import-time failures), so a circle is caught even when it never breaks an
import. Each source folder maps to the package it installs as (pyproject's package-dir).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"polyamp": ROOT / "polyamp", "polyamp.compat": ROOT / "compat",
            "polyamp.backends": ROOT / "backends"}


def _modules() -> dict[str, Path]:
    """Every module's import name -> its file (``pkg/__init__.py`` is the package ``pkg``)."""
    found = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = [package, *path.relative_to(folder).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _targets(name: str, path: Path, node: ast.AST, modules: dict[str, Path]) -> set[str]:
    """The project modules one import statement loads (a ``from m import sub`` loads m.sub)."""
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names if alias.name in modules}
    if not isinstance(node, ast.ImportFrom):
        return set()
    if node.level:  # relative to the importing module's package
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
        base = f"{base}.{node.module}" if node.module else base
    else:
        base = node.module or ""
    found = set()
    for alias in node.names:
        sub = f"{base}.{alias.name}"
        found.add(sub if sub in modules else base)
    return found & set(modules)


def import_graph() -> dict[str, set[str]]:
    """module -> the project modules it imports anywhere in its source (itself excluded)."""
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        edges: set[str] = set()
        for node in ast.walk(tree):
            edges |= _targets(name, path, node, modules)
        graph[name] = edges - {name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The import circles: strongly connected groups of two or more modules (Tarjan's)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[frozenset[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(frozenset(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_module_imports_one_that_imports_it_back():
    found = circles(import_graph())
    assert found == [], [sorted(c) for c in found]


def test_the_checker_sees_function_level_and_relative_imports():
    graph = import_graph()
    assert "polyamp.engine" in graph["polyamp.compat.torch"]  # absolute, module level
    assert "polyamp.compat._torch_state" in graph["polyamp.compat.torch"]  # relative
    assert "polyamp.compat.torch" in graph["polyamp"]  # inside polyamp.__getattr__
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [frozenset("abc")]
    assert circles({"a": {"b"}, "b": set()}) == []
