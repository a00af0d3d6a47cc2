"""Generic backend for any Python-array-API library, through array-api-compat.

Serves libraries without a dedicated plugin (array-api-strict, and others); it is also the
fallback for optional hooks a plugin leaves out. Several passes per gradient: correct,
not fast. In-place unscaling needs ``__setitem__``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import array_api_compat
import numpy as np

from polyamp._hookspecs import hookimpl
from polyamp.policy import LossScaleState, next_state

_xp = array_api_compat.array_namespace  # an array's namespace


@hookimpl
def backend_info() -> dict[str, Any]:
    return {"available": True, "reason": "", "version": array_api_compat.__version__}


@hookimpl
def owns_array(array: Any) -> bool:
    return array_api_compat.is_array_api_obj(array)


@hookimpl
def full(value: Any, dtype: str, like: Any) -> Any:
    if like is None:
        return np.full((), value, dtype=dtype)
    xp = _xp(like)
    return xp.full((), value, dtype=getattr(xp, dtype), device=array_api_compat.device(like))


@hookimpl
def scale_array(array: Any, scale: Any) -> Any:
    """``array * scale`` in ``array``'s dtype; narrower floats through float32 (a float16 scale of
    65536 would be inf), as the NumPy backend computes it."""
    xp = _xp(array)
    if array.dtype in (xp.float32, xp.float64):
        return array * xp.astype(scale, array.dtype)
    if not xp.isdtype(array.dtype, "real floating"):
        raise TypeError(f"scale() needs a floating-point array, got dtype={array.dtype}; "
                        "scale the loss, which is floating point")
    return xp.astype(xp.astype(array, xp.float32) * xp.astype(scale, xp.float32), array.dtype)


@hookimpl
def unscale_and_check(grads: Sequence[Any], scale: Any, found_inf: Any) -> None:
    xs = _xp(scale)
    inv = xs.astype(1.0 / xs.astype(scale, xs.float64), xs.float32)
    for grad in grads:
        xp = _xp(grad)
        bad = ~xp.all(xp.isfinite(grad))
        grad[...] = grad * xp.astype(inv, grad.dtype)
        found_inf[...] = xp.where(bad, xp.ones_like(found_inf), found_inf)


@hookimpl
def all_finite(arrays: Sequence[Any]) -> Any:
    result = None
    for array in arrays:
        xp = _xp(array)
        ok = xp.all(xp.isfinite(array))
        result = ok if result is None else result & ok
    return np.asarray(True) if result is None else result


@hookimpl
def cast(array: Any, dtype: str) -> Any:
    xp = _xp(array)
    target = getattr(xp, dtype, None)
    if target is None:
        raise TypeError(f"{xp.__name__} has no dtype {dtype!r}; cast to 'float32' or 'float16' instead")
    return xp.astype(array, target)


@hookimpl
def update_scale(state: Any, found_inf: Any, config: Any) -> Any:
    new = next_state(LossScaleState(*state), found_inf, config, _xp(state[0]))
    return LossScaleState(*new)


@hookimpl
def read_flag(found_inf: Any) -> bool:
    return bool(found_inf != 0)


@hookimpl
def to_host(array: Any) -> float | int:
    return int(array) if _xp(array).isdtype(array.dtype, "integral") else float(array)


# -- what the core needs beside the kernels: the defaults of the optional hooks ------------
_DLPACK_CPU = 1  # kDLCPU in DLPack's device enumeration


@hookimpl
def is_host(array: Any) -> bool:
    if isinstance(array, (np.ndarray, np.generic)):
        return True
    try:
        return array.__dlpack_device__()[0] == _DLPACK_CPU
    except Exception:  # no DLPack: treated as device memory
        return False


@hookimpl
def host_view(array: Any) -> Any:
    if isinstance(array, (np.ndarray, np.generic)):
        return np.asanyarray(array)  # an ndarray as it is
    if not is_host(array):
        return None
    try:
        return np.from_dlpack(array)
    except Exception:  # a dtype or layout this NumPy cannot view
        return None


@hookimpl
def to_numpy(array: Any) -> Any:
    view = host_view(array)
    return np.asarray(array) if view is None else view


@hookimpl
def from_host(values: Any, like: Any, dtype: Any) -> Any:
    xp = _xp(like)
    kind = getattr(xp, np.asarray(values).dtype.name) if dtype is None else dtype
    return xp.asarray(values, dtype=kind, device=array_api_compat.device(like), copy=True)


@hookimpl
def sum_of_squares(arrays: Sequence[Any]) -> Any:
    from polyamp.grads import squared_norm  # loaded on first use, as `import polyamp` leaves it

    return squared_norm(arrays)


@hookimpl
def pack(values: Sequence[Any], like: Any) -> Any:
    from polyamp import _dtypes

    xp = _xp(like)
    wide = "float64" if _dtypes.computes_float64(xp, array_api_compat.device(like)) else "float32"
    return xp.concat([xp.reshape(_dtypes.cast(v, wide), (-1,)) for v in values])


@hookimpl
def precision_counts(grads: Sequence[Any], scale: Any, bounds: Sequence[Any]) -> tuple[Any, Any]:
    from polyamp import _precision_counts as precision

    xp = array_api_compat.array_namespace(*grads)
    kinds = precision.array_api_kinds(xp, array_api_compat.device(grads[0]))
    return precision.count(xp, grads, scale, bounds, kinds)


def read_flags(arrays: Sequence[Any], device: Any, flags_of: Any, read: Any) -> list[bool]:
    """Per array a bool: ``flags_of(arrays of one device)`` (a 1-D bool array), ``read`` once each;
    ``device(array)`` names an array's device."""
    groups: dict[str, list[int]] = {}
    for i, array in enumerate(arrays):
        groups.setdefault(str(device(array)), []).append(i)
    finite = [True] * len(arrays)
    for indices in groups.values():
        for i, ok in zip(indices, read(flags_of([arrays[i] for i in indices])).tolist()):
            finite[i] = bool(ok)
    return finite


def _stacked_flags(arrays: Sequence[Any]) -> Any:
    xp = _xp(arrays[0])
    return xp.stack([xp.all(xp.isfinite(a)) for a in arrays])


@hookimpl
def finite_flags(arrays: Sequence[Any]) -> list[bool]:
    return read_flags(arrays, array_api_compat.device, _stacked_flags, to_numpy)


@hookimpl
def overflow_counts(array: Any) -> tuple[int, int, int, float]:
    """Counted in chunks of ``REPORT_CHUNK`` values: fixed-size temporaries however large the gradient
    (a big embedding's report must not run a nearly full GPU out of memory)."""
    xp = _xp(array)
    flat = xp.reshape(array, (-1,))
    size = flat.shape[0]
    totals = None
    for start in range(0, size, REPORT_CHUNK):  # a loop per chunk, on a skipped step's report only
        part = flat[start:min(start + REPORT_CHUNK, size)]  # in bounds: the array API says so
        stats = _chunk_counts(xp, part)
        totals = stats if totals is None else xp.concat([totals[:3] + stats[:3],
                                                         xp.maximum(totals[3:], stats[3:])])
    n_nan, n_pos, n_neg, largest = to_numpy(totals).tolist()
    return int(n_nan), int(n_pos), int(n_neg), float(largest)


#: Values per pass of :func:`overflow_counts` (its temporaries: a few bools and one float per value).
REPORT_CHUNK = 1 << 20


def _chunk_counts(xp: Any, part: Any) -> Any:
    """(nan, +inf, -inf, largest finite abs) of one chunk, as a float64 vector on its device."""
    nan = xp.count_nonzero(xp.isnan(part))
    posinf = xp.count_nonzero(part == math.inf)
    neginf = xp.count_nonzero(part == -math.inf)
    big = xp.max(xp.where(xp.isfinite(part), xp.abs(part), xp.zeros((), dtype=part.dtype)))
    return xp.stack([xp.astype(v, xp.float64) for v in (nan, posinf, neginf, big)])
