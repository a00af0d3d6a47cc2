"""Generic backend for any Python-array-API library, through array-api-compat.

Serves libraries without a dedicated plugin (array-api-strict, and others); it is also the
fallback for optional hooks a plugin leaves out. Several passes per gradient: correct,
not fast. In-place unscaling needs ``__setitem__``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import array_api_compat

from polyamp._hookspecs import hookimpl
from polyamp.policy import LossScaleState, next_state


def _xp(array: Any) -> Any:
    return array_api_compat.array_namespace(array)


@hookimpl
def backend_info() -> dict[str, Any]:
    return {"available": True, "reason": "", "version": array_api_compat.__version__}


@hookimpl
def owns_array(array: Any) -> bool:
    return array_api_compat.is_array_api_obj(array)


@hookimpl
def full(value: Any, dtype: str, like: Any) -> Any:
    if like is None:
        import numpy as np

        return np.full((), value, dtype=dtype)
    xp = _xp(like)
    return xp.full((), value, dtype=getattr(xp, dtype), device=array_api_compat.device(like))


@hookimpl
def scale_array(array: Any, scale: Any) -> Any:
    xp = _xp(array)
    return array * xp.astype(scale, array.dtype)


def _inv_scale(scale: Any) -> Any:
    xp = _xp(scale)
    return xp.astype(1.0 / xp.astype(scale, xp.float64), xp.float32)


@hookimpl
def unscale_and_check(grads: Sequence[Any], scale: Any, found_inf: Any) -> None:
    inv = _inv_scale(scale)
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
    if result is None:
        import numpy as np

        return np.asarray(True)
    return result


@hookimpl
def cast(array: Any, dtype: str) -> Any:
    xp = _xp(array)
    target = getattr(xp, dtype, None)
    if target is None:
        raise TypeError(
            f"{xp.__name__} has no dtype {dtype!r}; cast to 'float32' or 'float16' instead"
        )
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
    xp = _xp(array)
    return int(array) if xp.isdtype(array.dtype, "integral") else float(array)
