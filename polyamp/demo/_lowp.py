"""Rounding float32 values to a compute dtype, bit-identically but kept in float32 arrays: NumPy converts
float16 subnormals 10-20x slower than normal values, and subnormals are the regime the demo studies.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from polyamp import _dtypes

_EXPONENT, _SIGN = np.uint32(0x7F800000), np.uint32(0x80000000)
_F16_LOWEST = np.uint32((127 - 14) << 23)  # below 2**-14 the float16 quantum is 2**-24
_F16_HIGHEST = np.uint32((127 + 15) << 23)  # above 2**15 everything overflows anyway
_F16_SHIFT = np.uint32(13 << 23)  # float32 has 13 more significand bits than float16
_F16_MAX = np.float32(65504.0)


def _round_float16_numpy(x: np.ndarray) -> np.ndarray:
    """float32 ``x`` rounded to the nearest float16 (ties to even), as float32: adding and
    subtracting ``sign(x) * 2**(exponent(x) + 13)`` leaves exactly float16's significand bits."""
    bits = x.view(np.uint32)
    exponent = np.clip(bits & _EXPONENT, _F16_LOWEST, _F16_HIGHEST)
    exponent += _F16_SHIFT
    exponent |= bits & _SIGN
    magic = exponent.view(np.float32)
    rounded = x + magic
    rounded -= magic
    np.copysign(rounded, x, out=rounded)  # -tiny rounds to -0.0, as astype does
    overflow = np.abs(rounded) > _F16_MAX
    if overflow.any():
        rounded[overflow] = np.copysign(np.float32(np.inf), x[overflow])
    return rounded


def round_to(x: Any, name: str) -> Any:
    """Float32 ``x`` with every value rounded to the compute dtype ``name`` (``x`` for float32)."""
    if name == "float32":
        return x
    if name == "float16" and isinstance(x, np.ndarray) and x.dtype == np.float32:
        with np.errstate(over="ignore", invalid="ignore"):
            return _round_float16_numpy(np.ascontiguousarray(x))
    return _dtypes.cast(_dtypes.cast(x, name), "float32")
