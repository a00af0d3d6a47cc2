"""MkDocs hook: stage the installed import tree for mkdocstrings, with Markdown docstrings.

The source folders map to one import tree (``backends/`` -> ``polyamp.backends``, ``compat/`` ->
``polyamp.compat``, see pyproject's package-dir), which griffe cannot follow on disk. This hook
copies ``build/docs-src/polyamp`` together, laid out as the package installs; mkdocs.yml points
the python handler's ``paths`` there. It stages at start-up, before any plugin's ``on_config``:
the python handler lists its paths once, and a folder missing then (a fresh checkout) is never
searched, so the source tree's ``polyamp`` (without ``backends`` and ``compat``) would be loaded.
``on_config`` stages again, so ``mkdocs serve`` renders edited docstrings.

The docstrings use a little reStructuredText that Markdown shows raw; in the copies (never in
the sources) a role such as ``:class:`X``` becomes the code span ``X`` and a paragraph's closing
``::`` (a literal block follows) becomes ``:``.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STAGE = ROOT / "build" / "docs-src"
MAPPED = {"backends": "backends", "compat": "compat"}  # polyamp.<key> -> top-level folder
SKIP = shutil.ignore_patterns("__pycache__", "*.pyc")
ROLE = re.compile(r":(?:py:)?(?:class|func|meth|attr|mod|data|exc|obj|const):`(~?)([^`]+)`")
LITERAL_MARK = re.compile(r"(?<=[\w)`])::[ \t]*$", re.M)


def markdown_docstrings(source: str) -> str:
    """``source`` with RST roles as Markdown code spans and ``text::`` as ``text:``."""
    source = ROLE.sub(lambda m: f"`{m.group(2).rsplit('.', 1)[-1] if m.group(1) else m.group(2)}`", source)
    return LITERAL_MARK.sub(":", source)


def stage() -> Path:
    """Rebuild the staged tree: polyamp/* plus polyamp/backends and polyamp/compat; return its root."""
    package = STAGE / "polyamp"
    if STAGE.exists():
        shutil.rmtree(STAGE)
    shutil.copytree(ROOT / "polyamp", package, ignore=SKIP)
    for name, folder in MAPPED.items():
        shutil.copytree(ROOT / folder, package / name, ignore=SKIP)
    for path in package.rglob("*.py"):
        text = path.read_text(encoding="utf-8")
        converted = markdown_docstrings(text)
        if converted != text:
            path.write_text(converted, encoding="utf-8")
    return STAGE


def on_startup(command, dirty, **kwargs):
    """Stage before the handler first lists its paths."""
    stage()


def on_config(config, **kwargs):
    """Stage again for each (re)build, then hand the config on unchanged."""
    stage()
    return config
