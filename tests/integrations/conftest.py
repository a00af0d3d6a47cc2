"""Fixtures for the trainer tests: frameworks.py by path, and a skip naming what is missing."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest


def _frameworks():
    name = "polyamp_tests_frameworks"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name("frameworks.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


@pytest.fixture
def need():
    """``need("accelerate", ...)``: skip, saying which framework is absent and how to install it."""
    pytest.importorskip("torch")

    def require(*names: str) -> None:
        reason = _frameworks().require(*names)
        if reason:
            pytest.skip(reason)

    return require


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    """accelerate keeps one process-wide AcceleratorState: an Accelerator(mixed_precision=...) after
    another with a different one raises. Reset it around each test (as accelerate's own tests do)."""
    state = sys.modules.get("accelerate.state")
    if state is not None:
        state.AcceleratorState._reset_state(reset_partial_state=True)
    yield
    state = sys.modules.get("accelerate.state")
    if state is not None:
        state.AcceleratorState._reset_state(reset_partial_state=True)


@pytest.fixture
def installed():
    """polyamp.compat.torch.install() for one test, uninstalled even when the test fails."""
    import polyamp.compat.torch as pt

    with pt.install():
        yield pt
    assert not pt._INSTALLER.installed
