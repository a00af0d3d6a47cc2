"""NumPy backend: fused unscale-and-check (compiled with numba when present), bfloat16 via ml_dtypes.

On NumPy the state lives in host memory, so the scale update runs the readable rule of
``polyamp.policy`` directly on the 0-d arrays: reading them costs no device sync.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from polyamp.backends import _numpy_kernels, _numpy_squares
from polyamp.backends._scaling import scale_in_own_dtype

from polyamp._dtypes import numpy_bfloat16
from polyamp._hookspecs import hookimpl
from polyamp.policy import HostState, LossScaleState, next_host_state

_DTYPES = {"float32": np.float32, "float16": np.float16, "float64": np.float64, "int32": np.int32}


@hookimpl
def backend_info() -> dict[str, Any]:
    return {"available": True, "reason": "", "version": np.__version__}


@hookimpl
def owns_array(array: Any) -> bool:
    return isinstance(array, (np.ndarray, np.generic))


@hookimpl
def accepts_array(array: Any) -> bool:
    """Its arrays, and Python numbers (a loss given as a float), which it picks by default too."""
    return owns_array(array) or (isinstance(array, (int, float)) and not isinstance(array, bool))


@hookimpl
def full(value: Any, dtype: str, like: Any) -> Any:
    return np.full((), value, dtype=_DTYPES[dtype])


@hookimpl
def scale_array(array: Any, scale: Any) -> Any:
    array = np.asarray(array)
    return scale_in_own_dtype(array, scale, array.dtype.name,
                              lambda a, s: np.multiply(a, s, dtype=np.float32))


@hookimpl
def unscale_and_check(grads: Sequence[Any], scale: Any, found_inf: Any) -> None:
    inv_scale = np.asarray(np.float32(1.0 / np.float64(scale)))
    _numpy_kernels.unscale_and_check_(grads, inv_scale, found_inf)


@hookimpl
def unscale_and_squares(grads: Sequence[Any], scale: Any, found_inf: Any) -> Any:
    return _numpy_squares.unscale_and_squares(grads, np.float32(1.0 / np.float64(scale)), found_inf)


@hookimpl
def unscale_and_count(grads: Sequence[Any], scale: Any, found_inf: Any, bounds: Sequence[Any]) -> Any:
    from . import _numpy_counts  # at a meter's first sample step: it imports polyamp._precision_counts

    inv = np.float32(1.0 / np.float64(scale))
    return _numpy_counts.unscale_and_count(grads, inv, float(scale), found_inf, bounds)


@hookimpl
def sum_of_squares(arrays: Sequence[Any]) -> Any:
    return _numpy_squares.sum_of_squares(arrays)


@hookimpl
def all_finite(arrays: Sequence[Any]) -> Any:
    return np.asarray(_numpy_kernels.all_finite(arrays))


@hookimpl
def cast(array: Any, dtype: str) -> Any:
    if dtype not in ("float32", "float16", "float64", "bfloat16"):
        raise ValueError(f"dtype must be 'float32', 'float16' or 'bfloat16', got dtype={dtype!r}")
    return np.asarray(array).astype(numpy_bfloat16() if dtype == "bfloat16" else _DTYPES[dtype])


@hookimpl
def update_scale(state: Any, found_inf: Any, config: Any) -> Any:
    scale, growth, backoff = state
    host = HostState(float(scale), int(growth), int(backoff))
    new = next_host_state(host, bool(found_inf != 0), config)
    scale[...], growth[...], backoff[...] = new
    return LossScaleState(scale, growth, backoff)


@hookimpl
def read_flag(found_inf: Any) -> bool:
    return bool(found_inf != 0)


@hookimpl
def to_host(array: Any) -> float | int:
    return np.asarray(array).item()


# -- what the core needs beside the kernels: NumPy arrays are host memory -----------------
@hookimpl
def is_host(array: Any) -> bool:
    return True


@hookimpl
def host_view(array: Any) -> Any:
    return np.asarray(array)


to_numpy = host_view  # host memory: the view is the array's NumPy form


@hookimpl
def from_host(values: Any, like: Any, dtype: Any) -> Any:
    return np.array(values, dtype=dtype)


@hookimpl
def finite_flags(arrays: Sequence[Any]) -> list[bool]:
    """float32/64: max and min (no temporary array; nan propagates); else one isfinite pass."""
    return [bool(np.isfinite(a.max()) & np.isfinite(a.min())) if a.dtype.itemsize >= 4
            else bool(np.isfinite(a).all()) for a in map(np.asarray, arrays)]
