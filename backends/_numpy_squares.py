"""NumPy sum of squares for a StepGuard's gradient norm: one float64-accumulating pass per gradient,
or none of its own: fused into the unscale of float32 gradients (:func:`unscale_and_squares`).

numba loops (four float64 accumulators) where numba imports and the compiled unscale kernel is in
use; elsewhere, and for 16-bit dtypes, ``_numpy_kernels`` then ``polyamp.grads``' array-API passes.
Importing it imports only NumPy.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from . import _numpy_kernels as k


def _squares(a: Any) -> float:  # compiled by numba for float32 and float64 (see _load)
    s0 = s1 = s2 = s3 = 0.0
    n = a.size
    i = 0
    while i + 4 <= n:
        x0, x1, x2, x3 = np.float64(a[i]), np.float64(a[i + 1]), np.float64(a[i + 2]), np.float64(a[i + 3])
        s0 += x0 * x0
        s1 += x1 * x1
        s2 += x2 * x2
        s3 += x3 * x3
        i += 4
    while i < n:
        x = np.float64(a[i])
        s0 += x * x
        i += 1
    return (s0 + s1) + (s2 + s3)


_MASK, _CARRY, _TOP = np.uint32(0x7F800000), np.uint32(0x00800000), np.uint32(31)


def _unscale_squares_f32(g: Any, inv: Any) -> tuple[bool, float]:  # compiled by numba (see _load)
    """``g *= inv`` in place, whether an input was inf/nan (as ``_numpy_kernels``' float32 kernel:
    the exponent bits ORed), and the float64 sum of squares of the results, in one pass."""
    bits = g.view(np.uint32)
    acc = np.uint32(0)
    s0 = s1 = s2 = s3 = 0.0
    n = g.size
    i = 0
    while i + 4 <= n:
        acc = np.uint32(acc | ((bits[i] & _MASK) + _CARRY) | ((bits[i + 1] & _MASK) + _CARRY)
                        | ((bits[i + 2] & _MASK) + _CARRY) | ((bits[i + 3] & _MASK) + _CARRY))
        v0, v1, v2, v3 = g[i] * inv, g[i + 1] * inv, g[i + 2] * inv, g[i + 3] * inv
        g[i], g[i + 1], g[i + 2], g[i + 3] = v0, v1, v2, v3
        x0, x1, x2, x3 = np.float64(v0), np.float64(v1), np.float64(v2), np.float64(v3)
        s0 += x0 * x0
        s1 += x1 * x1
        s2 += x2 * x2
        s3 += x3 * x3
        i += 4
    while i < n:
        acc = np.uint32(acc | ((bits[i] & _MASK) + _CARRY))
        v = g[i] * inv
        g[i] = v
        x = np.float64(v)
        s0 += x * x
        i += 1
    return (acc >> _TOP) != 0, (s0 + s1) + (s2 + s3)


@functools.cache
def _load() -> tuple[dict[str, Callable[[np.ndarray], float]], Callable[..., tuple[bool, float]]] | None:
    """The sums of squares by dtype name and the fused float32 kernel, compiled once per process, or None."""
    try:
        import numba

        sums = {name: numba.njit(f"float64({name}[::1])", cache=True, nogil=True,
                                 fastmath={"reassoc"})(_squares) for name in ("float32", "float64")}
        return sums, numba.njit("Tuple((boolean, float64))(float32[::1], float32)", cache=True, nogil=True,
                                fastmath={"reassoc"})(_unscale_squares_f32)  # the sums vectorise
    except Exception:  # noqa: BLE001 - no numba, or it cannot compile here: the generic passes
        return None


def sum_of_squares(arrays: Sequence[np.ndarray]) -> np.ndarray:
    """The sum of squares of every value, a 0-d float64 array; no copy of float32/float64 gradients."""
    sums, _ = _load() or ({}, None)  # no numba: the generic passes
    total = 0.0
    rest = []
    for g in arrays:
        kernel = sums.get(g.dtype.name) if g.flags.c_contiguous else None
        if kernel is None:
            rest.append(g)
        elif g.size:
            total += kernel(g.reshape(-1))
    if rest:
        from polyamp.grads import squared_norm  # loaded on first use, as `import polyamp` leaves it

        total += float(squared_norm(rest))
    return np.asarray(total, np.float64)


def _fused_parts(fused: Any, x: np.ndarray, inv: np.float32) -> tuple[bool, float]:
    """The ``fused`` kernel on flat ``x``, cut into parts on ``_numpy_kernels``' threads as its unscale
    is (the parts' sums added in order)."""
    workers = k.threads()
    parts = min(workers, x.nbytes // k.PARALLEL_BYTES)
    if parts < 2:  # the usual gradient: no per-part calls on the step's path
        return fused(x, inv)
    step = -(-x.size // parts // 16) * 16
    results = k.on_threads(lambda i: fused(x[i * step:(i + 1) * step], inv), -(-x.size // step), workers)
    return any(bad for bad, _ in results), sum(total for _, total in results)


def fused_available() -> bool:
    """Whether the compiled fused kernel runs here (numba, and the compiled NumPy kernels requested)."""
    return _load() is not None and k._requested() == "compiled" and k.compiled_available()


def unscale_and_squares(grads: Sequence[np.ndarray], inv: np.float32, found_inf: np.ndarray) -> np.ndarray:
    """``_numpy_kernels.unscale_and_check_`` and :func:`sum_of_squares` of the results: fused for
    contiguous writable float32 gradients on the compiled path, else the two passes."""
    k.check_writable(grads, not inv == 1.0)
    loaded = _load() if fused_available() else None
    total, bad, rest = 0.0, False, []
    for g in grads:
        if loaded and g.dtype == np.float32 and g.flags.c_contiguous and g.flags.writeable and g.size:
            part_bad, part = _fused_parts(loaded[1], g.reshape(-1), inv)
            bad, total = bad or part_bad, total + part
        else:
            rest.append(g)
    if rest:
        k.unscale_and_check_(rest, np.asarray(inv), found_inf)
        total += float(sum_of_squares(rest))
    if bad:
        found_inf[...] = 1.0
    return np.asarray(total, np.float64)
