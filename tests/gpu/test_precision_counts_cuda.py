"""Issue 33, item 5 on a GPU: the fused unscale-and-count CUDA kernel, on cupy arrays and on torch
CUDA tensors (through the cupy backend's kernel): the gradients end bitwise as the unscale alone
leaves them (a NaN's payload aside), with the same flag, and the counts are those of the meter's
array-API passes on the unscaled values; a metered step on CUDA syncs once more on sample steps
only. Skipped, with the reason, where cupy or CUDA cannot run (tests/backends/
test_cupy_count_kernels_host.py runs the kernel's bodies on the CPU everywhere)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
from polyamp.backends import cupy as cupy_backend

import polyamp
from polyamp import LossScaleConfig, LossScaler, PrecisionMeter

pytestmark = pytest.mark.gpu
_INFO = cupy_backend.backend_info()
if not _INFO["available"]:
    pytest.skip(f"cupy backend unavailable: {_INFO['reason']}", allow_module_level=True)

import cupy  # noqa: E402


def _load(path: Path):
    spec = importlib.util.spec_from_file_location(f"_helpers_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_cases = _load(Path(__file__).resolve().parents[1] / "test_precision_counts.py")
ALL, mixed = _cases.ALL, _cases._mixed
NUMPY, CUPY = polyamp.get_backend("numpy"), polyamp.get_backend("cupy")
DTYPES = {"float32": np.float32, "float64": np.float64, "float16": np.float16}


def _host(dtype_name: str) -> list[np.ndarray]:
    values = mixed("float32" if dtype_name == "float64" else dtype_name)
    with np.errstate(over="ignore"):
        return [g.astype(DTYPES[dtype_name]) for g in values]


@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("scale", [2.0**13, 1.0, 3.0])
def test_cupy_fused_is_the_unscale_then_the_counts(dtype_name, scale):
    host = _host(dtype_name) + [np.full(301, 2.0**-20, DTYPES[dtype_name])]
    ours, theirs = [cupy.asarray(h) for h in host], [cupy.asarray(h) for h in host]
    ours[-1], theirs[-1] = ours[-1][::2], theirs[-1][::2]  # strided: counted on a copy, written back
    state = CUPY.full(scale, "float32", ours[0])
    found, want_found = CUPY.full(0.0, "float32", state), CUPY.full(0.0, "float32", state)
    CUPY.unscale_and_check(theirs, state, want_found)
    want = ALL.count(NUMPY, [cupy.asnumpy(t) for t in theirs], np.float32(scale))
    counts, extremes = CUPY.unscale_and_count(ours, state, found, ALL.bounds())
    bits = {2: np.uint16, 4: np.uint32, 8: np.uint64}
    for a, b in zip(ours, theirs, strict=True):  # bitwise: the same unscale body
        assert cupy.array_equal(cupy.ascontiguousarray(a).view(bits[a.itemsize]),
                                cupy.ascontiguousarray(b).view(bits[b.itemsize]))
    assert float(found) == float(want_found) == 1.0
    assert cupy.asnumpy(counts).tolist() == want.counts.tolist()
    assert cupy.asnumpy(extremes).tolist() == want.extremes.tolist()


torch = pytest.importorskip("torch")
needs_torch_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device")


@needs_torch_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64], ids=str)
def test_torch_cuda_gradients_count_through_the_cupy_kernel(dtype):
    host = _host("float32")
    grads = [torch.from_numpy(h.astype(np.float64)).to(device="cuda", dtype=dtype) for h in host]
    copies = [g.clone() for g in grads]
    backend = polyamp.get_backend("torch")
    scale = torch.tensor(2.0**13, device="cuda")
    found, want_found = torch.zeros((), device="cuda"), torch.zeros((), device="cuda")
    backend.unscale_and_check(copies, scale, want_found)
    want = ALL.count(backend, copies, scale)  # the array-API passes, on the device in float64
    counts, extremes = backend.unscale_and_count(grads, scale, found, ALL.bounds())
    assert counts.device == grads[0].device and counts.dtype == torch.int64
    bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[grads[0].element_size()]
    for a, b in zip(grads, copies, strict=True):
        nan = a.isnan()
        assert torch.equal(nan, b.isnan()) and torch.equal(a.view(bits)[~nan], b.view(bits)[~nan])
    assert found.item() == want_found.item() == 1.0
    assert counts.tolist() == want.counts.tolist() and extremes.tolist() == want.extremes.tolist()


@needs_torch_cuda
def test_a_metered_cuda_step_syncs_once_more_on_sample_steps_only(host_reads):
    def syncs(counts):
        return counts["_local_scalar_dense"] + counts["copy_to_cpu"]

    scaler = LossScaler(LossScaleConfig(init_scale=8.0, growth_interval=2), meter=PrecisionMeter(every=2))
    seen = []
    for _ in range(4):
        grads = [torch.full((300,), 2.0, device="cuda") * 1e-6, torch.ones(40, device="cuda")]
        with host_reads() as in_step:
            assert scaler.step(grads, lambda: None)
        with host_reads() as in_update:
            scaler.update()
        seen.append((syncs(in_step.counts), syncs(in_update.counts)))
    assert seen == [(1, 1), (1, 0), (1, 1), (1, 0)]
    assert scaler.last_precision.step == 2 and scaler.last_precision.tensors[0].numel == 300
