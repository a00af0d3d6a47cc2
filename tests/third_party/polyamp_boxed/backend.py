"""The polyamp backend for ``Boxed`` arrays: the required hooks and the optional ones a library
that is not array-API needs (the generic defaults cannot read a ``Boxed``)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from polyamp._hookspecs import hookimpl
from polyamp.policy import HostState, LossScaleState, next_host_state

from . import Boxed


# -- required --------------------------------------------------------------------------------
@hookimpl
def backend_info() -> dict[str, Any]:
    return {"available": True, "reason": "", "version": "0.1"}


@hookimpl
def owns_array(array: Any) -> bool:
    return isinstance(array, Boxed)


@hookimpl
def full(value: Any, dtype: str, like: Any) -> Any:
    return Boxed(np.full((), value, dtype=dtype))


@hookimpl
def unscale_and_check(grads: Sequence[Any], scale: Any, found_inf: Any) -> None:
    inv = np.float32(1.0 / np.float64(scale.data))
    for grad in grads:
        if not np.isfinite(grad.data).all():
            found_inf.data[...] = 1.0
        grad.data[...] = (grad.data.astype(np.float32) * inv).astype(grad.dtype)


@hookimpl
def update_scale(state: Any, found_inf: Any, config: Any) -> Any:
    scale, growth, backoff = state
    host = HostState(float(scale.data), int(growth.data), int(backoff.data))
    new = next_host_state(host, bool(found_inf.data != 0), config)
    scale.data[...], growth.data[...], backoff.data[...] = new
    return LossScaleState(scale, growth, backoff)


@hookimpl
def read_flag(found_inf: Any) -> bool:
    return bool(found_inf.data != 0)


# -- optional: kernels -----------------------------------------------------------------------
@hookimpl
def scale_array(array: Any, scale: Any) -> Any:
    return Boxed((array.data.astype(np.float32) * scale.data).astype(array.dtype))


@hookimpl
def to_host(array: Any) -> float | int:
    return array.data.item()


# -- optional: what the core needs from an array library --------------------------------------
@hookimpl
def is_host(array: Any) -> bool:
    return True


@hookimpl
def host_view(array: Any) -> Any:
    return array.data


@hookimpl
def to_numpy(array: Any) -> Any:
    return array.data


@hookimpl
def from_host(values: Any, like: Any, dtype: Any) -> Any:
    return Boxed(np.array(values, dtype=dtype))


@hookimpl
def finite_flags(arrays: Sequence[Any]) -> list[bool]:
    return [bool(np.isfinite(a.data).all()) for a in arrays]


@hookimpl
def overflow_counts(array: Any) -> tuple[int, int, int, float]:
    data = array.data.astype(np.float64)
    finite = data[np.isfinite(data)]
    largest = float(np.abs(finite).max()) if finite.size else 0.0
    return (int(np.isnan(data).sum()), int((data == math.inf).sum()), int((data == -math.inf).sum()),
            largest)
