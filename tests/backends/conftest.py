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


@pytest.fixture(scope="session")
def torch_amp_update():
    """``torch_amp_update(state, found, config) -> HostState``: one call of torch's own
    ``torch._amp_update_scale_`` on CPU tensors, the independent reference for torch's rule
    (configs with ``backoff_interval=1``, float64 products, no min/max besides polyamp's floor).

    torch lets a backoff fall below float32's smallest normal; polyamp stops at SCALE_FLOOR
    (docs/rule.md), so the result is ``max(torch's, SCALE_FLOOR)``. torch keeps no backoff
    tracker: it is 0 under this rule.
    """
    torch = pytest.importorskip("torch")
    from polyamp.config import SCALE_FLOOR
    from polyamp.policy import HostState

    def update(state, found, config):
        assert config.backoff_interval == 1 and config.products == "float64" and config.dynamic
        scale = torch.tensor([state.scale], dtype=torch.float32)
        growth = torch.tensor([state.growth_tracker], dtype=torch.int32)
        torch._amp_update_scale_(scale, growth, torch.tensor([float(found)]),
                                 config.growth_factor, config.backoff_factor, config.growth_interval)
        return HostState(max(scale.item(), SCALE_FLOOR), growth.item(), 0)

    return update
