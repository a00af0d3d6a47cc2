"""GPU tests: each carries the ``gpu`` mark and skips, saying why, where CUDA is absent."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def pair():
    """The side-by-side training helpers shared with tests/compat (loaded by path)."""
    pytest.importorskip("torch")
    name = "polyamp_tests_torch_pair"
    if name not in sys.modules:
        path = Path(__file__).parents[1] / "compat" / "_torch_pair.py"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]
