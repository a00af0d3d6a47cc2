"""Fixtures for the facade tests: the side-by-side training helpers (host_reads: tests/conftest.py)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest


def load_pair_module():
    """tests/compat/_torch_pair.py as a module (tests are imported by path, not as a package)."""
    name = "polyamp_tests_torch_pair"
    if name not in sys.modules:
        path = Path(__file__).with_name("_torch_pair.py")
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


@pytest.fixture(scope="session")
def pair():
    """The side-by-side training helpers of tests/compat/_torch_pair.py."""
    pytest.importorskip("torch")
    return load_pair_module()
