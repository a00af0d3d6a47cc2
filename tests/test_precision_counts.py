"""Issue 33, item 2: the precision counts are exact at every boundary, for every target format and
input dtype, against a plain float64 reference written from the definitions (constants from
``ml_dtypes.finfo``, not from polyamp), and equal on every backend."""

from __future__ import annotations

import math

import numpy as np
import pytest

import polyamp
from polyamp.precision import FloatFormat, PrecisionMeter

ml_dtypes = pytest.importorskip("ml_dtypes")

TARGETS = ("float16", "bfloat16", "float8_e4m3fn", "float8_e5m2")
INPUTS = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
NUMPY = polyamp.get_backend("numpy")


def _finfo(name: str):
    return np.finfo(np.float16) if name == "float16" else ml_dtypes.finfo(getattr(ml_dtypes, name))


def _constants(name: str) -> tuple[float, float, float, float]:
    """(m, n, M, ulp(M)) from ml_dtypes: the reference's own constants."""
    f = _finfo(name)
    big = float(f.max)
    ulp = float(f.eps) * 2.0 ** math.floor(math.log2(big))
    return float(f.smallest_subnormal), float(f.smallest_normal), big, ulp


def reference(values: np.ndarray, target: str, scale: float | str) -> list[int]:
    """[numel, zeros, nonfinite, underflow, subnormal, overflow], one Python float at a time."""
    m, n, big, ulp = _constants(target)
    flat = [float(x) for x in np.asarray(values, np.float64).reshape(-1)]
    finite = [x for x in flat if math.isfinite(x)]
    if scale == "amax":
        amax = max((abs(x) for x in finite), default=0.0)
        scale = big / amax if amax > 0 else 1.0
    out = [len(flat), sum(x == 0 for x in flat), len(flat) - len(finite), 0, 0, 0]
    for x in finite:
        v = abs(x) * scale
        if x == 0:
            continue
        out[3] += v <= m / 2
        out[4] += m / 2 < v < n - m / 2
        out[5] += v >= big + ulp / 2
    return out


def boundaries(target: str) -> list[float]:
    """|v| at every boundary of ``target``: m/2, n - m/2, M + ulp(M)/2 (and M, m, n)."""
    m, n, big, ulp = _constants(target)
    return [m / 2, m, n - m / 2, n, big, big + ulp / 2]


def near(value: float, dtype) -> list[float]:
    """``value`` in ``dtype`` and its two neighbours there on each side (signs both ways)."""
    x = np.asarray([value]).astype(dtype)
    found = [x + 0] + [_step(x, dtype, d * k) for d in (1, -1) for k in (1, 2)]
    return [s * float(v[0]) for v in found for s in (1.0, -1.0)]


def _step(x: np.ndarray, dtype, steps: int) -> np.ndarray:
    """``x`` (positive) moved ``steps`` representable values of ``dtype`` up or down: one per step of
    its bits (NumPy's nextafter has no bfloat16 loop)."""
    bits = {2: np.uint16, 4: np.uint32}[np.dtype(dtype).itemsize]
    return (x.view(bits).astype(np.int64) + steps).astype(bits).view(dtype)


def case(target: str, dtype_name: str) -> list[tuple[float, np.ndarray]]:
    """Per boundary, a power-of-two scale that brings it near 1 and the input values around it."""
    dtype = INPUTS[dtype_name]
    cases = []
    for b in boundaries(target):
        scale = 2.0 ** math.floor(math.log2(b))
        values = [v for v in near(b / scale, dtype) if math.isfinite(v)] + [0.0, -0.0, math.inf, math.nan]
        cases.append((scale, np.asarray(values, np.float64).astype(dtype)))
    return cases


@pytest.mark.parametrize("dtype_name", list(INPUTS))
@pytest.mark.parametrize("target", TARGETS)
def test_counts_equal_the_float64_reference_at_every_boundary(target, dtype_name):
    meter = PrecisionMeter(targets=[(target, "loss")])
    hits = set()
    for scale, values in case(target, dtype_name):
        counts, extremes = meter.count(NUMPY, [values], scale)
        assert counts.tolist() == reference(values, target, scale), (scale, values)
        finite = np.abs(values[np.isfinite(values)].astype(np.float64))
        assert extremes.tolist() == [finite.max(), -finite[finite > 0].min()]
        hits |= {float(v) * scale for v in np.abs(values.astype(np.float64))}
    if dtype_name == "float32":  # every boundary itself was measured, not only its neighbours
        assert set(boundaries(target)) <= hits


@pytest.mark.parametrize("target", TARGETS)
def test_a_number_scale_and_the_amax_scale_follow_the_reference(target):
    rng = np.random.default_rng(3)
    grads = [(rng.standard_normal(4000) * 10.0 ** rng.uniform(-12, 4, 4000)).astype(np.float32),
             np.array([0.0, 2.0**-140, 1e-30, -3.0], np.float32), np.zeros(5, np.float32)]
    meter = PrecisionMeter(targets=[(target, 2.0**-3), (target, 1000.0), (target, "amax")])
    counts, _ = meter.count(NUMPY, grads, None)
    rows = meter.layout(len(grads)).rows(counts, np.zeros(2 * len(grads)))
    for g, row in zip(grads, rows):
        for j, scale in enumerate((2.0**-3, 1000.0, "amax")):
            want = reference(g, target, scale)
            assert list(row.counts) == want[:3] and list(row.targets[j]) == want[3:]


@pytest.mark.parametrize("target", ["float16", "bfloat16", "float8_e5m2", "float8_e4m3fn"])
def test_the_counts_say_what_the_cast_does(target):
    """underflow: the cast gives 0; subnormal: a subnormal; overflow: inf (the IEEE formats) or NaN
    (e4m3fn, except the tie at M + ulp(M)/2 itself, which ml_dtypes rounds to M: the definition
    counts it as overflow, as the docs say)."""
    m, n, big, ulp = _constants(target)
    kind = np.float16 if target == "float16" else getattr(ml_dtypes, target)
    rng = np.random.default_rng(5)
    v = np.concatenate([np.asarray(b, np.float64) * (1 + rng.uniform(-2**-6, 2**-6, 500))
                        for b in boundaries(target)] + [np.asarray(boundaries(target))])
    meter = PrecisionMeter(targets=[(target, 1.0)])
    counts, _ = meter.count(NUMPY, [v], 1.0)
    with np.errstate(over="ignore"):
        cast = v.astype(kind).astype(np.float64)
    gone = np.sum(cast == 0)
    subnormal = np.sum((cast != 0) & (np.abs(cast) < n))
    lost = np.sum(~np.isfinite(cast)) + (np.sum(v == big + ulp / 2) if target == "float8_e4m3fn" else 0)
    assert counts.tolist()[3:] == [gone, subnormal, lost]


def test_the_format_constants_are_ml_dtypes_own():
    from polyamp._precision_targets import FORMATS

    extra = [FloatFormat("float8_e4m3fnuz", 4, 3, "fnuz"), FloatFormat("float8_e5m2fnuz", 5, 2, "fnuz")]
    for fmt in [*FORMATS.values(), *extra]:
        m, n, big, ulp = _constants(fmt.name)
        assert (fmt.smallest_subnormal, fmt.smallest_normal, fmt.max, fmt.ulp_of_max) == (m, n, big, ulp)


def _library_arrays(backend_name, values: np.ndarray, dtype_name: str):
    """``values`` (float64) as ``backend_name``'s array of ``dtype_name``, or None where it has none."""
    if backend_name == "numpy":
        return values.astype(INPUTS[dtype_name])
    if backend_name == "torch":
        import torch

        return torch.from_numpy(values).to(getattr(torch, dtype_name))
    if backend_name == "paddle":
        import paddle

        return paddle.to_tensor(values).astype(dtype_name)
    if backend_name == "array_api":
        import array_api_strict as xps

        return xps.asarray(values.astype(np.float32)) if dtype_name == "float32" else None  # its only float
    return None


def _mixed(dtype_name: str) -> list[np.ndarray]:
    """Gradients with every boundary of every target, random values, zeros, infs and nans."""
    rng = np.random.default_rng(11)
    spread = rng.standard_normal(3000) * 10.0 ** rng.uniform(-40, 6, 3000)
    edges = [v for t in TARGETS for _, values in case(t, dtype_name) for v in values.astype(np.float64)]
    odd = np.array([math.inf, -math.inf, math.nan, 1.0])
    values = [spread, np.asarray(edges), np.zeros(7), np.zeros(0), odd]
    with np.errstate(over="ignore"):
        return [v.astype(INPUTS[dtype_name]).astype(np.float64) for v in values]


ALL = PrecisionMeter(targets=[(t, s) for t in TARGETS for s in ("loss", 1.0, "amax")])


@pytest.mark.parametrize("dtype_name", list(INPUTS))
def test_every_backend_counts_what_numpy_counts(backend_name, dtype_name, to_numpy):
    grads = _mixed(dtype_name)
    arrays = [_library_arrays(backend_name, g, dtype_name) for g in grads]
    if arrays[0] is None:
        pytest.skip(f"{backend_name} has no {dtype_name} here")
    want = ALL.count(NUMPY, [g.astype(INPUTS[dtype_name]) for g in grads], 2.0**13)
    backend = polyamp.get_backend(backend_name)
    got = ALL.count(backend, arrays, backend.full(2.0**13, "float32", arrays[0]))
    counts, extremes = to_numpy(got.counts), to_numpy(got.extremes)
    assert str(counts.dtype) == "int64" and str(extremes.dtype) == "float64"
    assert counts.tolist() == want.counts.tolist()
    assert extremes.tolist() == want.extremes.tolist()
    assert counts.shape == (ALL.layout(len(grads)).sizes[0],)


def test_counts_leave_the_gradients_as_they_were():
    g = np.array([1e-9, 3.0, np.inf], np.float32)
    before = g.copy()
    PrecisionMeter().count(NUMPY, [g], 2.0**16)
    assert np.array_equal(g, before, equal_nan=True)
