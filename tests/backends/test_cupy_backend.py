"""The cupy backend on any machine: availability and its reason, lazy imports, host-side helpers.

GPU behaviour is in tests/gpu/test_cupy_backend.py; the kernels themselves are compiled and
run on the host in test_cupy_kernels_compile.py and test_cupy_kernels_host.py.
"""

from __future__ import annotations

import gc
import subprocess
import sys

import numpy as np
import pytest
from polyamp.backends import cupy as cupy_backend
from polyamp.backends._cupy_kernels import build_table
from polyamp.backends._cupy_launch import _IdentityPlans, dtype_kind, group_by_kind

import polyamp
from polyamp import BackendUnavailableError, LossScaleConfig
from polyamp.policy import LossScaleState


def cupy_problem() -> str | None:
    """None when cupy can run here, else text the backend's reason must contain."""
    try:
        import cupy
    except ImportError:
        return "cupy is not installed"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:
        return f"no CUDA device is available: {exc}"
    if count < 1:
        return "found 0 CUDA devices"
    try:
        from cupy_backends.cuda.libs import nvrtc

        nvrtc.getVersion()
    except Exception:
        return "cannot load NVRTC"
    return None


PROBLEM = cupy_problem()
needs_unavailable = pytest.mark.skipif(
    PROBLEM is None, reason="cupy can run on this machine: tests/gpu covers it"
)


def run_python(code: str) -> None:
    """Run ``code`` in a fresh interpreter (so sys.modules starts empty); fail on error."""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_backend_info_says_why_cupy_cannot_run():
    info = cupy_backend.backend_info()
    if PROBLEM is None:
        assert info["available"] and info["reason"] == ""
    else:
        assert info["available"] is False
        assert PROBLEM in info["reason"], info["reason"]


def test_available_backends_lists_cupy_without_raising():
    infos = {i.name: i for i in polyamp.available_backends()}
    assert "cupy" in infos
    assert infos["cupy"].available is (PROBLEM is None)
    if PROBLEM is not None:
        assert PROBLEM in infos["cupy"].reason


@needs_unavailable
@pytest.mark.parametrize("how", ["argument", "environment", "torch facade"])
def test_choosing_cupy_raises_with_the_reason(how, monkeypatch):
    with pytest.raises(BackendUnavailableError) as err:
        if how == "argument":
            polyamp.LossScaler(backend="cupy")
        elif how == "environment":
            monkeypatch.setenv("POLYAMP_BACKEND", "cupy")
            polyamp.LossScaler()
        else:
            from polyamp.compat.torch import GradScaler

            GradScaler(backend="cupy")
    message = str(err.value)
    assert "'cupy'" in message and PROBLEM in message and "Fix:" in message


def test_import_and_discovery_import_neither_cupy_nor_torch():
    run_python(
        "import sys, polyamp; from polyamp import _registry; _registry._plugins(); "
        "import polyamp.backends.cupy; "
        "assert 'cupy' not in sys.modules and 'torch' not in sys.modules, 'imported'"
    )


def test_owns_array_and_accepts_array_do_not_import_cupy():
    run_python(
        "import sys, numpy as np; from polyamp.backends import cupy as b; "
        "assert not b.owns_array(np.ones(3)) and not b.accepts_array(np.ones(3)); "
        "assert not b.owns_array(object()) and not b.accepts_array(object()); "
        "assert 'cupy' not in sys.modules, 'cupy imported'"
    )


def test_a_numpy_scaler_does_not_import_cupy():
    run_python(
        "import sys, numpy as np, polyamp; s = polyamp.LossScaler(backend='numpy'); "
        "g = np.full(4, 8.0, np.float32); s.unscale_([g]); s.update(); "
        "assert (g == 8.0 / 65536).all(); assert 'cupy' not in sys.modules, 'cupy imported'"
    )


class DLPackDevice:
    """A minimal DLPack producer that only reports where its memory lives."""

    def __init__(self, device_type: int) -> None:
        self.device_type = device_type

    def __dlpack_device__(self) -> tuple[int, int]:
        if self.device_type < 0:
            raise RuntimeError("this producer cannot say")
        return (self.device_type, 0)


class CudaArrayInterface:
    """An object exposing only ``__cuda_array_interface__`` (as numba device arrays do)."""

    __cuda_array_interface__ = {"shape": (1,), "typestr": "<f4", "data": (0, False), "version": 3}


def test_accepts_cuda_arrays_of_other_libraries_but_owns_none():
    for cuda in (DLPackDevice(2), DLPackDevice(13), CudaArrayInterface()):
        assert cupy_backend.accepts_array(cuda) and not cupy_backend.owns_array(cuda)
    for host in (DLPackDevice(1), DLPackDevice(3), DLPackDevice(-1), np.ones(2), [1.0], 3.0):
        assert not cupy_backend.accepts_array(host)


def test_cpu_torch_tensors_are_not_accepted():
    torch = pytest.importorskip("torch")
    assert not cupy_backend.accepts_array(torch.ones(3))


def test_cast_rejects_unknown_dtypes_before_touching_cupy():
    with pytest.raises(ValueError, match="dtype='int8'"):
        cupy_backend.cast(np.ones(2), "int8")


def test_static_scale_update_launches_nothing():
    state = LossScaleState(object(), object(), object())  # not even arrays: nothing is touched
    assert cupy_backend.update_scale(state, None, LossScaleConfig(dynamic=False)) is state


def test_dtype_kind_reads_numpy_torch_and_ml_dtypes_names():
    assert dtype_kind(np.dtype(np.float32)) == "float32"
    assert dtype_kind(np.dtype(np.float16)) == "float16"
    assert dtype_kind(np.dtype(np.int32)) is None
    ml_dtypes = pytest.importorskip("ml_dtypes")
    assert dtype_kind(np.dtype(ml_dtypes.bfloat16)) == "bfloat16"
    torch = pytest.importorskip("torch")
    assert dtype_kind(torch.bfloat16) == "bfloat16" and dtype_kind(torch.float64) == "float64"


def test_chunk_table_layout():
    table, n_chunks = build_table([0x1000, 0x2000, 0x3000], [0, 20, 8], chunk=8)
    assert n_chunks == 4  # the empty tensor gets no chunk, 20 elements get three
    assert table.dtype == np.int64
    assert table.tolist() == [0x1000, 0x2000, 0x3000, 0, 20, 8,
                              1 << 32, (1 << 32) | 1, (1 << 32) | 2, 2 << 32]


def test_chunk_table_keeps_high_pointers_bit_exact():
    table, _ = build_table([2**64 - 16], [1], chunk=8)
    assert table[:1].view(np.uint64)[0] == 2**64 - 16


def test_chunk_table_of_nothing_is_empty():
    table, n_chunks = build_table([], [], chunk=8)
    assert n_chunks == 0 and table.size == 0


@pytest.mark.parametrize("chunk", [0, 12, -8, 2**31])
def test_chunk_size_must_be_a_positive_multiple_of_8(chunk):
    with pytest.raises(ValueError, match=f"chunk={chunk}"):
        build_table([0], [1], chunk=chunk)


def test_group_by_kind_keeps_first_seen_order():
    entries = [("float16", 1, 10), ("float32", 2, 20), ("float16", 3, 30)]
    assert group_by_kind(entries) == {"float16": ([1, 3], [10, 30]), "float32": ([2], [20])}


def test_identity_plan_cache_drops_an_entry_when_an_array_dies():
    cache = _IdentityPlans(capacity=4)
    a, b = np.zeros(1), np.zeros(2)
    key = (id(a), id(b))
    cache.put(key, [a, b], "plan")
    assert cache.get(key) == "plan"
    del b
    gc.collect()
    assert cache.get(key) is None


def test_identity_plan_cache_evicts_the_oldest_beyond_capacity():
    cache = _IdentityPlans(capacity=2)
    arrays = [np.zeros(1) for _ in range(3)]
    for i, a in enumerate(arrays):
        cache.put((id(a),), [a], i)
    assert cache.get((id(arrays[0]),)) is None
    assert [cache.get((id(a),)) for a in arrays[1:]] == [1, 2]
