"""MkDocs hook: stage the installed import tree for mkdocstrings.

The source folders map to one import tree (``backends/`` -> ``polyamp.backends``, ``compat/`` ->
``polyamp.compat``, see pyproject's package-dir), which griffe cannot follow on disk. This hook
builds ``build/docs-src/polyamp`` out of symlinks, laid out as the package installs, before any
page is rendered; mkdocs.yml points the python handler's ``paths`` there.
"""

from __future__ import annotations

import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STAGE = ROOT / "build" / "docs-src"
MAPPED = {"backends": "backends", "compat": "compat"}  # polyamp.<key> -> top-level folder


def on_config(config, **kwargs):
    """Rebuild the staged tree: polyamp/* plus polyamp/backends and polyamp/compat."""
    package = STAGE / "polyamp"
    if STAGE.exists():
        shutil.rmtree(STAGE)
    package.mkdir(parents=True)
    for entry in (ROOT / "polyamp").iterdir():
        if entry.name != "__pycache__":
            (package / entry.name).symlink_to(entry)
    for name, folder in MAPPED.items():
        (package / name).symlink_to(ROOT / folder, target_is_directory=True)
    return config
