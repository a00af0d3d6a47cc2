"""What may enter the engine: gradients, outputs, scales and flags, refused before any state changes.

Each check is O(1) per object (an isinstance or an attribute look-up), never per element, and each
message names the argument, the value and the fix.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import numpy as np

from ._errors import ConfigError, ForeignArrayError
from .backend import Backend
from .config import check_scale, short_repr

#: Gradient types no kernel can unscale in place: scalars are immutable, and np.matrix stays
#: 2-D under reshape(-1), which breaks the flat kernels.
_NOT_IN_PLACE = (np.generic, np.matrix, int, float, complex)


def gradient_list(grads: Iterable[Any]) -> list[Any]:
    """The non-None gradients, refusing (TypeError, naming the index) those that cannot change in place."""
    if hasattr(grads, "shape"):
        raise TypeError(
            f"grads must be a list of gradient arrays, got one {type(grads).__module__}."
            f"{type(grads).__name__}. Fix: pass [grad]."
        )
    grads = list(grads)
    arrays = [g for g in grads if g is not None]
    if any(issubclass(kind, _NOT_IN_PLACE) for kind in set(map(type, arrays))):  # one check per type
        i, grad = next((i, g) for i, g in enumerate(grads) if isinstance(g, _NOT_IN_PLACE))
        raise TypeError(_not_in_place(i, grad))
    return arrays


def _not_in_place(index: int, grad: Any) -> str:
    if isinstance(grad, np.matrix):
        return (
            f"grads[{index}] is a numpy.matrix, which the kernels cannot unscale in place. "
            "Fix: pass np.asarray(m), an ndarray view of the same memory."
        )
    kind = f"{type(grad).__module__}.{type(grad).__name__}"
    return (
        f"grads[{index}] is a scalar ({kind}, value {short_repr(grad)}), which cannot be changed "
        "in place, so it cannot be unscaled. Fix: keep each gradient in an array (a 0-d array "
        "such as np.array(1.0, np.float32) works), and pass that array."
    )


def check_outputs(outputs: Any, where: str = "outputs") -> None:
    """Refuse None, alone or inside lists/tuples: scaling it would silently do nothing."""
    if outputs is None:
        raise TypeError(
            f"scale() needs outputs to be an array or a list/tuple of arrays, got {where}=None. "
            "Fix: pass the loss array, e.g. scaler.scale(loss)."
        )
    if isinstance(outputs, (list, tuple)):
        for i, item in enumerate(outputs):
            check_outputs(item, f"{where}[{i}]")


def scale_value(value: Any) -> float:
    """A new scale as a checked float: a number, or a 1-element array read once (a sync on a GPU)."""
    if hasattr(value, "shape") and not isinstance(value, np.generic):
        shape = tuple(value.shape)
        if math.prod(shape) != 1:
            raise ConfigError(
                f"set_scale() needs value to be a number or a 1-element array, got an array of "
                f"shape {shape}. Fix: pass e.g. value=65536.0."
            )
        if hasattr(value, "reshape"):
            value = value.reshape(())
        else:  # strict array-API arrays have no methods
            import array_api_compat

            value = array_api_compat.array_namespace(value).reshape(value, ())
        value = value.item() if hasattr(value, "item") else float(value)
    return check_scale("value", value)


def flag_value(found_inf: Any, backend: Backend | None) -> Any:
    """``found_inf`` as a host bool, or the array itself when ``backend`` (if bound) owns it."""
    if isinstance(found_inf, (bool, np.bool_)):
        return bool(found_inf)
    if not hasattr(found_inf, "shape"):
        raise TypeError(
            f"update() needs found_inf to be True/False or a flag array, got "
            f"found_inf={short_repr(found_inf)} ({type(found_inf).__name__}). "
            "Fix: pass found_inf=True/False, or leave it out to use this iteration's checks."
        )
    if backend is not None and not backend.owns_array(found_inf):
        raise ForeignArrayError(
            f"update() got found_inf of type {type(found_inf).__module__}.{type(found_inf).__name__}, "
            f"which is not an array of the bound backend {backend.name!r}. Fix: pass the flag "
            "unscale_() returned, or True/False."
        )
    return found_inf
