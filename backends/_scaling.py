"""``scale_array`` for NumPy-like libraries: the loss scaled in its own dtype (numpy, cupy)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def scale_in_own_dtype(array: Any, scale: Any, name: str, multiply_f32: Callable[[Any, Any], Any]) -> Any:
    """``array * scale`` in ``array``'s dtype (called ``name``): float32/float64 as they are,
    other floats (float16, bfloat16) by ``multiply_f32`` in float32, rounded back."""
    if name in ("float32", "float64"):
        return array * scale
    if name.startswith("float") or name == "bfloat16":
        return multiply_f32(array, scale).astype(array.dtype)
    raise TypeError(f"scale() needs a floating-point array, got dtype={name}; "
                    "scale the loss, which is floating point")
