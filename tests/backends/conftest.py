"""Fixtures for the backend tests: the nvcc kernel check tool and nvcc itself."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

TOOL = Path(__file__).resolve().parents[2] / "tools" / "check_cuda_kernels.py"


def _load_tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location("check_cuda_kernels", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def check_tool() -> ModuleType:
    """``tools/check_cuda_kernels.py`` loaded as a module."""
    return _load_tool()


@pytest.fixture(scope="session")
def nvcc(check_tool) -> str:
    """Path to nvcc; the test skips, saying so, when there is none."""
    path = check_tool.find_nvcc(None)
    if path is None:
        pytest.skip("nvcc not found on PATH, $CUDA_HOME or /usr/local/cuda: cannot compile CUDA")
    return path
