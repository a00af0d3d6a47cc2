"""NumPy sum of squares for a StepGuard's gradient norm: one float64-accumulating pass per gradient.

A numba loop (four float64 accumulators, each value widened before it is squared) where numba
imports, compiled once per process (cached on disk); elsewhere, and for 16-bit dtypes, the
array-API passes of ``polyamp.grads`` (float64 copies in chunks). Importing it imports only NumPy.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

_kernels: dict[str, Callable[[np.ndarray], float]] | None = None
_tried = False


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


def _load() -> dict[str, Callable[[np.ndarray], float]] | None:
    global _kernels, _tried
    if not _tried:
        _tried = True
        try:
            import numba

            _kernels = {name: numba.njit(f"float64({name}[::1])", cache=True, nogil=True)(_squares)
                        for name in ("float32", "float64")}
        except Exception:  # noqa: BLE001 - no numba, or it cannot compile here: the generic passes
            _kernels = None
    return _kernels


def sum_of_squares(arrays: Sequence[np.ndarray]) -> np.ndarray:
    """The sum of squares of every value, a 0-d float64 array; no copy of float32/float64 gradients."""
    kernels = _load()
    total = 0.0
    rest = []
    for g in arrays:
        kernel = None if kernels is None or not g.flags.c_contiguous else kernels.get(g.dtype.name)
        if kernel is None:
            rest.append(g)
        elif g.size:
            total += kernel(g.reshape(-1))
    if rest:
        from polyamp.grads import squared_norm  # loaded on first use, as `import polyamp` leaves it

        total += float(squared_norm(rest))
    return np.asarray(total, np.float64)
