"""Issue 33, item 5: the fused unscale-check-count (``unscale_and_count``) of the NumPy and torch CPU
backends leaves the gradients and the flag as ``unscale_and_check`` does and counts bit for bit what
``precision_counts`` counts on the unscaled values, at every boundary of every target."""

from __future__ import annotations

import math

import numpy as np
import pytest
from polyamp.backends import _numpy_counts, _numpy_kernels

import polyamp
from polyamp.precision import PrecisionMeter

ml_dtypes = pytest.importorskip("ml_dtypes")
pytestmark = pytest.mark.skipif(not _numpy_counts.fused_available(), reason="no numba: nothing fused")

TARGETS = ("float16", "bfloat16", "float8_e4m3fn", "float8_e5m2")
INPUTS = {"float32": np.float32, "float64": np.float64, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
NUMPY = polyamp.get_backend("numpy")
ALL = PrecisionMeter(targets=[(t, s) for t in TARGETS for s in ("loss", 1.0, "amax")])


def _constants(name: str) -> tuple[float, float, float, float]:
    f = np.finfo(np.float16) if name == "float16" else ml_dtypes.finfo(getattr(ml_dtypes, name))
    big = float(f.max)
    return float(f.smallest_subnormal), float(f.smallest_normal), big, float(f.eps) * 2.0 ** math.floor(
        math.log2(big))


def _near(value: float, dtype) -> list[float]:
    """``value`` in ``dtype`` and two neighbours each side of it there, both signs."""
    x = np.asarray([value]).astype(dtype)
    bits = {2: np.uint16, 4: np.uint32, 8: np.uint64}[np.dtype(dtype).itemsize]
    out = []
    for k in (-2, -1, 0, 1, 2):
        v = float((x.view(bits).astype(np.int64) + k).astype(bits).view(dtype)[0])
        out += [v, -v]
    return [v for v in out if math.isfinite(v)]


def _reference(grads, scale, meter=ALL):
    """(gradients, flag, counts, extremes) of the unfused passes: unscale, then the counts."""
    grads = [g.copy() for g in grads]
    flag = np.zeros((), np.float32)
    NUMPY.unscale_and_check(grads, np.float32(scale), flag)
    got = meter.count(NUMPY, grads, np.float32(scale))
    return grads, float(flag), got.counts.tolist(), got.extremes.tolist()


def _fused(grads, scale, meter=ALL):
    grads = [g.copy() for g in grads]
    flag = np.zeros((), np.float32)
    counts, extremes = NUMPY.unscale_and_count(grads, np.float32(scale), flag, meter.bounds())
    assert counts.dtype == np.int64 and extremes.dtype == np.float64
    return grads, float(flag), counts.tolist(), extremes.tolist()


def _same(a, b):
    (ga, fa, ca, ea), (gb, fb, cb, eb) = a, b
    assert [g.tobytes() for g in ga] == [g.tobytes() for g in gb]
    assert (fa, ca, ea) == (fb, cb, eb)


@pytest.mark.parametrize("dtype_name", list(INPUTS))
@pytest.mark.parametrize("target", TARGETS)
def test_every_boundary_is_counted_as_the_unfused_passes_count_it(target, dtype_name):
    """Inputs next to m/2, m, n - m/2, n, M and M + ulp(M)/2 (after a power-of-two target scale), with
    zeros, infs and nans; the loss scale 1 keeps them as they are, 2**13 moves them."""
    m, n, big, ulp = _constants(target)
    dtype, values, scales = INPUTS[dtype_name], [0.0, -0.0, math.inf, -math.inf, math.nan], []
    for b in (m / 2, m, n - m / 2, n, big, big + ulp / 2):
        k = 2.0 ** math.floor(math.log2(b))
        scales.append(k)
        values += _near(b / k, dtype)
    meter = PrecisionMeter(targets=[(target, s) for s in [*dict.fromkeys(scales), "loss", "amax"]])
    grads = [np.asarray(values, np.float64).astype(dtype), np.asarray(values[5:], np.float64).astype(dtype)]
    for scale in (1.0, 2.0**13, 2.0**-3):
        _same(_fused(grads, scale, meter), _reference(grads, scale, meter))


@pytest.mark.parametrize("dtype_name", list(INPUTS))
def test_random_gradients_of_every_magnitude_count_alike(dtype_name):
    rng = np.random.default_rng(7)
    with np.errstate(all="ignore"):
        spread = (rng.standard_normal(40000) * 10.0 ** rng.uniform(-45, 40, 40000)).astype(INPUTS[dtype_name])
    grads = [spread, np.zeros(0, spread.dtype), np.zeros(9, spread.dtype), spread[:3000].reshape(30, 100)]
    for scale in (2.0**16, 1.0, 3.0):
        _same(_fused(grads, scale), _reference(grads, scale))


def test_a_gradient_cut_across_threads_counts_as_one(monkeypatch):
    """A gradient of at least 2 * PARALLEL_BYTES runs in parts on threads; inf and nan in the last."""
    monkeypatch.setattr(_numpy_kernels, "_forced_threads", 2)
    rng = np.random.default_rng(1)
    g = (rng.standard_normal(3 * _numpy_kernels.PARALLEL_BYTES // 4) * 1e-6).astype(np.float32)
    g[5], g[-3], g[-1] = 0.0, np.inf, np.nan
    _same(_fused([g], 2.0**10), _reference([g], 2.0**10))


def test_gradients_the_kernel_cannot_take_are_unscaled_and_counted_by_the_passes():
    rng = np.random.default_rng(2)
    strided = rng.standard_normal((64, 64)).astype(np.float32)[:, ::2]
    fortran = np.asfortranarray(rng.standard_normal((8, 9)).astype(np.float32))
    plain = rng.standard_normal(100).astype(np.float32) * 1e-9
    _same(_fused([strided, plain, fortran], 2.0**20), _reference([strided, plain, fortran], 2.0**20))


def test_a_read_only_gradient_is_refused_before_any_gradient_changes():
    first, locked = np.ones(4, np.float32), np.ones(4, np.float32)
    locked.flags.writeable = False
    flag = np.zeros((), np.float32)
    with pytest.raises(ValueError, match="read-only"):
        NUMPY.unscale_and_count([first, locked], np.float32(2.0), flag, ALL.bounds())
    assert first.tolist() == [1.0] * 4 and float(flag) == 0.0


def test_the_limits_are_the_last_bits_whose_float64_product_passes():
    for name in ("float32", "float16", "bfloat16", "float64"):
        for s, t, strict in ((3.0, 2.0**-25, False), (2.0**13, 65520.0, True), (1e300, 1.0, True)):
            b = _numpy_counts.limit(name, s, t, strict)
            def ok(v, t=t, strict=strict):
                return v < t if strict else v <= t

            assert ok(_numpy_counts.value(b, name) * s)
            assert b == {"float32": 0x7F7FFFFF, "float64": 0x7FEFFFFFFFFFFFFF}.get(name, -1) or not ok(
                _numpy_counts.value(b + 1, name) * s)


torch = pytest.importorskip("torch")


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "bfloat16"])
def test_torch_cpu_counts_and_unscales_as_its_two_passes(dtype):
    """float32/float64/float16 through the compiled kernel on the tensors' memory; bfloat16 through
    torch's unscale and the array-API counts: both equal to the unfused passes."""
    backend = polyamp.get_backend("torch")
    rng = np.random.default_rng(3)
    with np.errstate(all="ignore"):
        values = rng.standard_normal(20000) * 10.0 ** rng.uniform(-45, 40, 20000)
    values[:4] = [0.0, np.inf, -np.nan, -0.0]
    grads = [torch.from_numpy(values).to(getattr(torch, dtype)), torch.zeros(0, dtype=getattr(torch, dtype))]
    scale = torch.tensor(2.0**13)
    want, flag = [g.clone() for g in grads], torch.zeros(())
    backend.unscale_and_check(want, scale, flag)
    ref = ALL.count(backend, want, scale)
    got, flag2 = [g.clone() for g in grads], torch.zeros(())
    counts, extremes = backend.unscale_and_count(got, scale, flag2, ALL.bounds())
    bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}
    assert all(torch.equal(a.view(bits[a.element_size()]), b.view(bits[b.element_size()]))
               for a, b in zip(want, got))
    assert float(flag2) == float(flag) == 1.0
    assert counts.tolist() == ref.counts.tolist() and extremes.tolist() == ref.extremes.tolist()
