"""polyamp/_errors.py's docstring lists every exception class polyamp defines (and raises)."""

from __future__ import annotations

import ast
from pathlib import Path

from polyamp import _errors

ROOT = Path(__file__).resolve().parents[1]


def _exception_classes() -> set[str]:
    """Public classes under polyamp/, compat/, backends/ whose bases name an Error or Exception."""
    found = set()
    for folder in ("polyamp", "compat", "backends"):
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                    bases = [ast.unparse(b) for b in node.bases]
                    if any(b.endswith(("Error", "Exception")) for b in bases):
                        found.add(node.name)
    return found


def test_every_exception_class_is_in_the_hierarchy() -> None:
    classes = _exception_classes()
    assert len(classes) >= 17, sorted(classes)
    missing = sorted(name for name in classes if f" {name}" not in _errors.__doc__)
    assert not missing, f"add these to polyamp/_errors.py's docstring: {missing}"
