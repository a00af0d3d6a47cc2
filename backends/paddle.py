"""PaddlePaddle backend: paddle's own unscale kernel, the scale update as tensor ops; lazy import.

float32 gradients go through ``paddle._C_ops.check_finite_and_unscale_`` (paddle's GradScaler's
kernel, on CPU too), other dtypes through tensor ops; the scale update is
:func:`polyamp.policy.next_state` over the paddle namespace below, never reading the device
(docs/backends/paddle.md). Importing this module does not import paddle.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import math
import operator
import sys
from collections.abc import Sequence
from typing import Any

from polyamp._errors import install_hint
from polyamp._hookspecs import hookimpl
from polyamp.policy import LossScaleState, next_state

_CASTS = ("float32", "float16", "bfloat16", "float64")


def _paddle() -> Any:
    import paddle

    return paddle


def _dtype_name(array: Any) -> str:
    """``"float32"`` for paddle.float32 (paddle prints dtypes as ``paddle.float32``)."""
    return str(array.dtype).rsplit(".", 1)[-1]


@hookimpl
def backend_info() -> dict[str, Any]:
    """Found without importing paddle (a slow, noisy import): its spec and installed version."""
    if "paddle" in sys.modules:
        return {"available": True, "reason": "", "version": sys.modules["paddle"].__version__}
    if importlib.util.find_spec("paddle") is None:
        reason = f"paddle is not installed. Fix: {install_hint('paddle')} (on GPUs: paddlepaddle-gpu)"
        return {"available": False, "reason": reason, "version": None}
    return {"available": True, "reason": "", "version": _installed_version()}


def _installed_version() -> str | None:
    for dist in ("paddlepaddle", "paddlepaddle-gpu"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


@hookimpl
def owns_array(array: Any) -> bool:
    paddle = sys.modules.get("paddle")
    tensor = getattr(paddle, "Tensor", None)
    return tensor is not None and isinstance(array, tensor)


@hookimpl
def full(value: Any, dtype: str, like: Any) -> Any:
    paddle = _paddle()
    place = getattr(like, "place", None)  # None: paddle's current default place
    return paddle.to_tensor(value, dtype=dtype, place=place)


@hookimpl
def scale_array(array: Any, scale: Any) -> Any:
    name = _dtype_name(array)
    if name == "float32":
        return array * scale
    if name == "float64":
        return array * scale.astype("float64")
    if name in ("float16", "bfloat16"):
        return (array.astype("float32") * scale).astype(name)
    raise TypeError(f"scale() needs a floating-point tensor, got dtype={name}; "
                    "scale the loss, which is floating point")


@hookimpl
def unscale_and_check(grads: Sequence[Any], scale: Any, found_inf: Any) -> None:
    paddle = _paddle()
    fp32 = [g for g in grads if _dtype_name(g) == "float32"]
    others = [g for g in grads if _dtype_name(g) != "float32"]
    flags = []
    with paddle.no_grad():
        if fp32:
            _, flag = paddle._C_ops.check_finite_and_unscale_(fp32, scale)
            flags.append(flag.reshape([]))
        if others:
            flags += _unscale_by_ops(paddle, others, scale)
        for flag in flags:
            paddle.assign(paddle.maximum(found_inf, flag.astype(found_inf.dtype)), output=found_inf)


@hookimpl
def unscale_and_check_keep(grads: Sequence[Any], scale: Any, found_inf: Any) -> None:
    """Every dtype by ops (paddle's fused float32 kernel writes ``grad * 0`` on an overflow)."""
    paddle = _paddle()
    with paddle.no_grad():
        for flag in _unscale_by_ops(paddle, list(grads), scale):
            paddle.assign(paddle.maximum(found_inf, flag.astype(found_inf.dtype)), output=found_inf)


def _unscale_by_ops(paddle: Any, grads: Sequence[Any], scale: Any) -> list[Any]:
    """Unscale non-float32 gradients in place, in float32 (float64 for float64); their flags."""
    inv_scale = (1.0 / scale.astype("float64")).astype("float32")
    flags = []
    for grad in grads:
        name = _dtype_name(grad)
        wide = "float64" if name == "float64" else "float32"
        flags.append(paddle.logical_not(paddle.isfinite(grad).all()))
        unscaled = grad.astype(wide) * inv_scale.astype(wide)
        paddle.assign(unscaled.astype(name), output=grad)
    return flags


@hookimpl
def all_finite(arrays: Sequence[Any]) -> Any:
    paddle = _paddle()
    if not arrays:
        return paddle.to_tensor(True)
    return functools.reduce(paddle.logical_and, [paddle.isfinite(array).all() for array in arrays])


@hookimpl
def cast(array: Any, dtype: str) -> Any:
    if dtype not in _CASTS:
        raise ValueError(f"dtype must be 'float32', 'float16' or 'bfloat16', got dtype={dtype!r}")
    return array.astype(dtype)


class PaddleNamespace:
    """The array-API names :func:`polyamp.policy.next_state` (on 0-d paddle tensors) and
    :func:`polyamp._precision_counts.count` use.

    New constants are made on the place of ``like``, so the update never leaves the device.
    """

    float32 = "float32"
    float64 = "float64"
    int32 = "int32"
    int64 = "int64"

    def __init__(self, like: Any) -> None:
        self._paddle = _paddle()
        self._like = like

    _SAME_AS_PADDLE = frozenset({"where", "zeros_like", "isfinite", "maximum", "minimum", "full_like",
                                 "abs", "count_nonzero", "max", "min"})

    def __getattr__(self, name: str) -> Any:
        """paddle's own function where its signature is the array API's (``where``, ``max``, ...)."""
        if name not in self._SAME_AS_PADDLE:
            raise AttributeError(f"'PaddleNamespace' object has no attribute {name!r}", name=name, obj=self)
        return getattr(self._paddle, name)

    def __dir__(self) -> list[str]:
        return sorted({*super().__dir__(), *self._SAME_AS_PADDLE})

    def astype(self, x: Any, dtype: str) -> Any:
        return x.astype(dtype)

    def asarray(self, value: Any, dtype: str, device: Any = None) -> Any:
        if device is not None:  # a 0-d constant on that place (the counts)
            return self._paddle.to_tensor(value, dtype=dtype, place=device)
        return self._paddle.full_like(self._like, value, dtype=dtype)

    def reshape(self, x: Any, shape: tuple[int, ...]) -> Any:
        return x.reshape(list(shape))

    def stack(self, arrays: Sequence[Any]) -> Any:
        return self._paddle.stack(list(arrays))


@hookimpl
def update_scale(state: Any, found_inf: Any, config: Any) -> Any:
    state = LossScaleState(*state)
    return next_state(state, found_inf, config, PaddleNamespace(state.scale))


@hookimpl
def precision_counts(grads: Sequence[Any], scale: Any, bounds: Sequence[Any]) -> tuple[Any, Any]:
    """The counts' one algorithm over :class:`PaddleNamespace`, in float64."""
    from polyamp._precision_counts import Kinds, count

    kinds = Kinds("float64", "int64", grads[0].place)
    return count(PaddleNamespace(grads[0]), grads, scale, bounds, kinds)


@hookimpl
def read_flag(found_inf: Any) -> bool:
    return found_inf.item() != 0


@hookimpl
def to_host(array: Any) -> float | int:
    return array.item()


# -- what the core needs beside the kernels (paddle tensors are no array-API arrays) --------
@hookimpl
def is_host(array: Any) -> bool:
    return array.place.is_cpu_place()


@hookimpl
def to_numpy(array: Any) -> Any:
    """One host read; bfloat16 as float32 (paddle's numpy() would give its raw uint16 bits)."""
    if _dtype_name(array) == "bfloat16":
        array = array.astype("float32")
    return array.numpy()


@hookimpl
def from_host(values: Any, like: Any, dtype: Any) -> Any:
    return _paddle().to_tensor(values, dtype=dtype, place=like.place)


@hookimpl
def sum_of_squares(arrays: Sequence[Any]) -> Any:
    """float64 squares summed per tensor (paddle has no float64 dot of a float32 tensor)."""
    paddle = _paddle()
    parts = [paddle.sum(paddle.square(g.astype("float64"))) for g in arrays]
    return functools.reduce(operator.add, parts) if parts else None


@hookimpl
def pack(values: Sequence[Any], like: Any) -> Any:
    paddle = _paddle()
    return paddle.concat([v.astype("float64").reshape([-1]) for v in values])


def _finite_stacked(tensors: list[Any]) -> Any:
    paddle = _paddle()
    return paddle.stack([paddle.isfinite(t).all() for t in tensors])


@hookimpl
def finite_flags(arrays: Sequence[Any]) -> list[bool]:
    from polyamp.backends.array_api import read_flags

    return read_flags(arrays, lambda t: t.place, _finite_stacked, to_numpy)


@hookimpl
def overflow_counts(array: Any) -> tuple[int, int, int, float]:
    """Tensor ops in float32 for 16-bit dtypes (paddle's CPU abs has no 16-bit kernel)."""
    paddle = _paddle()
    wide = array.astype("float32") if _dtype_name(array).endswith("16") else array
    ok = paddle.isfinite(array)
    counts = [paddle.sum(m.astype("int64")) for m in (paddle.isnan(array), array == math.inf,
                                                         array == -math.inf)]
    big = paddle.max(paddle.where(ok, paddle.abs(wide), paddle.zeros_like(wide)))
    n_nan, n_pos, n_neg, largest = paddle.stack([v.astype("float64") for v in (*counts, big)]).tolist()
    return int(n_nan), int(n_pos), int(n_neg), float(largest)
