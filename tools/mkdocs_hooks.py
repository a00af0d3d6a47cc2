"""MkDocs hook: stage the installed import tree for mkdocstrings.

The source folders map to one import tree (``backends/`` -> ``polyamp.backends``, ``compat/`` ->
``polyamp.compat``, see pyproject's package-dir), which griffe cannot follow on disk. This hook
copies ``build/docs-src/polyamp`` together, laid out as the package installs, before any page is
rendered; mkdocs.yml points the python handler's ``paths`` there. Copies, not symlinks: griffe
resolves a symlink to its real folder and would load ``polyamp`` from the source tree again,
without ``polyamp.backends`` and ``polyamp.compat``.
"""

from __future__ import annotations

import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STAGE = ROOT / "build" / "docs-src"
MAPPED = {"backends": "backends", "compat": "compat"}  # polyamp.<key> -> top-level folder
SKIP = shutil.ignore_patterns("__pycache__", "*.pyc")


def on_config(config, **kwargs):
    """Rebuild the staged tree: polyamp/* plus polyamp/backends and polyamp/compat."""
    package = STAGE / "polyamp"
    if STAGE.exists():
        shutil.rmtree(STAGE)
    shutil.copytree(ROOT / "polyamp", package, ignore=SKIP)
    for name, folder in MAPPED.items():
        shutil.copytree(ROOT / folder, package / name, ignore=SKIP)
    return config
