"""Fixtures for the backend tests: the nvcc kernel check tool, nvcc itself and the cupy kernels'
host build."""

from __future__ import annotations

import ctypes
import importlib.util
import subprocess
from pathlib import Path
from types import ModuleType

import numpy as np
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


@pytest.fixture(scope="session")
def cupy_host_lib(nvcc, tmp_path_factory):
    """``cupy_host_harness.cu`` over the cupy backend's CUDA source, built as a shared library with
    nvcc for the CPU (skips when nvcc is absent): the kernels' bodies, run on the host."""
    from polyamp.backends import _cupy_kernels as kern

    work = tmp_path_factory.mktemp("harness")
    (work / "polyamp_cupy_kernels.cu").write_text(kern.ALL_SOURCE)
    harness = Path(__file__).with_name("cupy_host_harness.cu")
    so = work / "harness.so"
    subprocess.run([nvcc, "-DPOLYAMP_HOST_ONLY", f"-I{work}", "-Xcompiler", "-fPIC", "-shared",
                    "-o", str(so), str(harness)], check=True, capture_output=True)
    lib = ctypes.CDLL(str(so))
    p, i64 = ctypes.c_void_p, ctypes.c_longlong
    lib.polyamp_host_unscale.argtypes = [ctypes.c_int, p, ctypes.c_int, i64, ctypes.c_int, p, p,
                                         ctypes.c_int, i64, i64]
    lib.polyamp_host_unscale.restype = ctypes.c_int
    lib.polyamp_host_unscale_count.argtypes = [ctypes.c_int, p, ctypes.c_int, i64, ctypes.c_int, p, p,
                                               p, ctypes.c_int, ctypes.c_int, p, p, i64, i64]
    lib.polyamp_host_unscale_count.restype = ctypes.c_int
    lib.polyamp_host_update.argtypes = [p, p, p, p, ctypes.c_double, ctypes.c_double,
                                        ctypes.c_int, ctypes.c_int, ctypes.c_float,
                                        ctypes.c_float, ctypes.c_int]
    return lib


@pytest.fixture(scope="session")
def cupy_host_update(cupy_host_lib):
    """``update(state, found, config) -> HostState``: one run of the cupy update kernel's body on
    the host, with the arguments the launcher passes (``_cupy_launch.update_flags``)."""
    from polyamp.backends._cupy_launch import update_flags

    from polyamp.policy import HostState

    def update(state, found, config):
        scale = np.array(state.scale, np.float32)
        growth = np.array(state.growth_tracker, np.int32)
        backoff = np.array(state.backoff_tracker, np.int32)
        flag = np.array(found, np.float32)
        with np.errstate(over="ignore"):
            lo, hi = np.float32(config.min_scale or 0.0), np.float32(config.max_scale or 0.0)
        cupy_host_lib.polyamp_host_update(
            scale.ctypes.data, growth.ctypes.data, backoff.ctypes.data, flag.ctypes.data,
            config.growth_factor, config.backoff_factor, config.growth_interval,
            config.backoff_interval, lo, hi, update_flags(config))
        return HostState(float(scale), int(growth), int(backoff))

    return update
