"""Issue 33, item 5: the cupy backend's unscale-and-count CUDA kernel, its bodies run on the CPU
(``cupy_host_harness.cu``, built by nvcc, no GPU needed), launched as ``_cupy_launch`` launches it:
the gradients end bitwise as the unscale kernel leaves them, with the same flag, and the counts are
the NumPy reference's (``polyamp._precision_counts`` on the unscaled values) at every boundary."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
from polyamp.backends import _cupy_kernels as kern
from polyamp.backends._cupy_launch import (
    dtype_kind,
    empty_counts,
    finish_counts,
    group_by_kind,
    target_table,
)

import polyamp
from polyamp.precision import PrecisionMeter


def _load(path: Path):
    """A test module's helpers, loaded by path under a name of its own (the tests are no package)."""
    spec = importlib.util.spec_from_file_location(f"_helpers_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_here = Path(__file__).resolve()
_cases = _load(_here.parents[1] / "test_precision_counts.py")  # the boundary cases and mixed gradients
_host = _load(_here.with_name("test_cupy_kernels_host.py"))  # the unscale kernel's host launch
KIND_CODE, aligned_or_not, host_unscale = _host.KIND_CODE, _host.aligned_or_not, _host.host_unscale
ALL, INPUTS, TARGETS, _mixed, case = _cases.ALL, _cases.INPUTS, _cases.TARGETS, _cases._mixed, _cases.case
NUMPY = polyamp.get_backend("numpy")


def host_unscale_count(lib, arrays, scale, found, bounds, *, chunk=64, threads=8, max_blocks=5):
    """Launch as ``_cupy_launch.unscale_and_count`` does (per dtype, phase 1 with an amax target),
    emulated on the host: ``(counts, extremes)`` from ``finish_counts``."""
    scale_arr = np.asarray(scale, dtype=np.float32)
    targets = target_table(bounds)
    n = len(bounds)
    phases = (0, 1) if any(b.scale == "amax" for b in bounds) else (0,)
    raw, extremes = empty_counts(np, len(arrays), n)
    entries = [(dtype_kind(a.dtype), a.ctypes.data, a.size) for a in arrays]
    kinds = [e[0] for e in entries]
    for kind, (ptrs, sizes) in group_by_kind(entries).items():
        where = [i for i, k in enumerate(kinds) if k == kind]
        part_raw, part_extremes = empty_counts(np, len(where), n)
        table, n_chunks = kern.build_table(ptrs, sizes, chunk)
        if n_chunks:
            for phase in phases:
                rc = lib.polyamp_host_unscale_count(
                    KIND_CODE[kind], table.ctypes.data, len(ptrs), n_chunks, chunk, scale_arr.ctypes.data,
                    found.ctypes.data, targets.ctypes.data, n, phase, part_raw.ctypes.data,
                    part_extremes.ctypes.data, min(n_chunks, max_blocks), threads)
                assert rc == 0
        raw[where], extremes[where] = part_raw, part_extremes
    sizes = np.asarray([a.size for a in arrays], np.int64)
    return finish_counts(np, raw, extremes, sizes, n)


def _aligned(arrays, rng):
    """Copies of ``arrays``, every other one at an address that is not 16-byte aligned."""
    out = []
    for i, a in enumerate(arrays):
        b = aligned_or_not(rng, a.dtype, a.size, misaligned=i % 2 == 1)
        b[...] = a
        out.append(b)
    return out


@pytest.mark.parametrize("dtype_name", list(INPUTS))
@pytest.mark.parametrize("scale", [2.0**13, 1.0, 3.0, 2.0**-20])
def test_the_kernel_counts_what_numpy_counts_after_the_same_unscale(cupy_host_lib, dtype_name, scale):
    rng = np.random.default_rng(int(scale * 7) % 1000)
    dtype = INPUTS[dtype_name]
    with np.errstate(over="ignore"):
        grads = _aligned([g.astype(dtype) for g in _mixed(dtype_name)] + [np.full(300, 2.0**-30, dtype)], rng)
    plain = [g.copy() for g in grads]
    want_found, found = np.zeros((), np.float32), np.zeros((), np.float32)
    host_unscale(cupy_host_lib, plain, scale, want_found)
    want = ALL.count(NUMPY, plain, np.float32(scale))
    counts, extremes = host_unscale_count(cupy_host_lib, grads, scale, found, ALL.bounds())
    for got, ref in zip(grads, plain, strict=True):  # bitwise the unscale kernel's results
        np.testing.assert_array_equal(got.view(np.uint8), ref.view(np.uint8))
    assert float(found) == float(want_found) == 1.0  # _mixed holds an inf and a nan
    assert counts.tolist() == want.counts.tolist()
    assert extremes.tolist() == want.extremes.tolist()


@pytest.mark.parametrize("dtype_name", list(INPUTS))
@pytest.mark.parametrize("target", TARGETS)
def test_the_kernel_counts_every_boundary_exactly(cupy_host_lib, target, dtype_name):
    """The boundary cases of tests/test_precision_counts.py, unscaled by 1 (values as they are)."""
    meter = PrecisionMeter(targets=[(target, "loss"), (target, "amax"), (target, 0.5)])
    for scale, values in case(target, dtype_name):
        with np.errstate(all="ignore"):
            grads = [values.copy(), values[::-1].copy()]
            # the loss target at `scale` with values unscaled by 1: scale the state, not the values
            want = meter.count(NUMPY, grads, np.float32(scale))
        found = np.zeros((), np.float32)
        counts, extremes = host_unscale_count(cupy_host_lib, grads, 1.0, found, _at(meter, scale))
        assert counts.tolist() == want.counts.tolist(), (scale, values)
        assert extremes.tolist() == want.extremes.tolist()


def _at(meter, scale):
    """The meter's bounds with its "loss" target at ``scale`` (a number target: the same counts)."""
    return [b._replace(scale=float(np.float32(scale))) if b.scale == "loss" else b for b in meter.bounds()]


@pytest.mark.parametrize("chunk,threads,max_blocks", [(64, 4, 3), (8, 1, 1), (16384, 256, 4), (64, 32, 100)])
def test_every_value_is_counted_once_whatever_the_launch_shape(cupy_host_lib, chunk, threads, max_blocks):
    sizes = [0, 1, 7, 8, 63, 64, 65, 129, 257, 3 * chunk + 5]
    grads = [np.full(n, 2.0**-20, np.float32) for n in sizes]
    meter = PrecisionMeter(targets=[("float16", 1.0)])
    found = np.zeros((), np.float32)
    counts, _ = host_unscale_count(cupy_host_lib, grads, 1.0, found, meter.bounds(), chunk=chunk,
                                   threads=threads, max_blocks=max_blocks)
    rows = counts.reshape(len(sizes), -1)
    assert rows[:, 0].tolist() == sizes and rows[:, 3].tolist() == [0] * len(sizes)
    assert rows[:, 4].tolist() == sizes  # 2**-20 is a float16 subnormal, each counted once
