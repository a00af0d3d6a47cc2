"""The NumPy backend's StepGuard kernels: the sum of squares, and the unscale fused with it.

The fused kernel must leave the gradients bitwise as the unfused unscale does and raise the same
flag; its sum differs from a float64 reference only by reassociation (float64 adds of exact
float32 squares: relative error far below 1e-12 at these sizes).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from polyamp.backends import _numpy_kernels, _numpy_squares


def _reference(grads):
    return math.fsum(float(v) ** 2 for g in grads for v in g.astype(np.float64).reshape(-1))


def _grads(seed, sizes=(7, 1000, 2_100_003)):  # the last is cut into parts on threads
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(n).astype(np.float32) * np.float32(2.0**10) for n in sizes]


@pytest.mark.parametrize("inv", [np.float32(2.0**-10), np.float32(1 / 3), np.float32(1.0)])
def test_fused_unscale_equals_the_unfused_kernel_and_sums_the_squares(inv):
    fused, plain = _grads(0), _grads(0)
    flag_fused, flag_plain = np.zeros((), np.float32), np.zeros((), np.float32)
    total = _numpy_squares.unscale_and_squares(fused, inv, flag_fused)
    _numpy_kernels.unscale_and_check_(plain, np.asarray(inv), flag_plain)
    for a, b in zip(fused, plain):
        assert np.array_equal(a.view(np.uint32), b.view(np.uint32))  # bitwise
    assert flag_fused == flag_plain == 0
    assert total.dtype == np.float64 and float(total) == pytest.approx(_reference(plain), rel=1e-12)
    assert float(_numpy_squares.sum_of_squares(plain)) == pytest.approx(_reference(plain), rel=1e-12)


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_a_non_finite_input_raises_the_flag(bad):
    grads = _grads(1)
    grads[2][1_500_000] = bad  # in the second thread's part
    flag = np.zeros((), np.float32)
    _numpy_squares.unscale_and_squares(grads, np.float32(0.5), flag)
    assert flag == 1


def test_other_dtypes_and_layouts_take_the_unfused_passes():
    rng = np.random.default_rng(2)
    grads = [rng.standard_normal(50).astype(np.float16), rng.standard_normal((8, 6)).astype(np.float32).T,
             rng.standard_normal(9)]  # float16, a transposed (non-contiguous) view, float64
    copies = [g.copy() for g in grads]
    flag, again = np.zeros((), np.float32), np.zeros((), np.float32)
    total = _numpy_squares.unscale_and_squares(grads, np.float32(0.5), flag)
    _numpy_kernels.unscale_and_check_(copies, np.asarray(np.float32(0.5)), again)
    for a, b in zip(grads, copies):
        np.testing.assert_array_equal(a, b)
    assert float(total) == pytest.approx(_reference(copies), rel=1e-12) and flag == again == 0


def test_a_read_only_gradient_is_refused_before_anything_changes():
    grads = _grads(3, sizes=(4, 4))
    before = [g.copy() for g in grads]
    grads[1].flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        _numpy_squares.unscale_and_squares(grads, np.float32(0.5), np.zeros((), np.float32))
    np.testing.assert_array_equal(grads[0], before[0])


def test_the_blocked_kernel_is_not_fused_and_gives_the_same_result():
    fused, blocked = _grads(4), _grads(4)
    total = _numpy_squares.unscale_and_squares(fused, np.float32(0.25), np.zeros((), np.float32))
    _numpy_kernels.set_kernel("blocked")
    try:
        other = _numpy_squares.unscale_and_squares(blocked, np.float32(0.25), np.zeros((), np.float32))
    finally:
        _numpy_kernels.set_kernel(None)
    for a, b in zip(fused, blocked):
        np.testing.assert_array_equal(a, b)
    assert float(other) == pytest.approx(float(total), rel=1e-12)
