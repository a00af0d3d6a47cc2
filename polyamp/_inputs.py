"""What may enter the engine: gradients, outputs, scales and flags, refused before any state changes
(O(1) per object, never per element)."""

from __future__ import annotations

import math
import operator
from collections.abc import Iterable
from typing import Any

import numpy as np

from ._dtypes import FLOATING, short_name
from ._errors import ConfigError, ForeignArrayError
from .backend import Backend
from .config import check_scale, short_repr

#: Gradient types no kernel can unscale in place (scalars; np.matrix stays 2-D under reshape(-1)).
_NOT_IN_PLACE = (np.generic, np.matrix, int, float, complex)
_DTYPE = operator.attrgetter("dtype")
# (dtype type, dtype) already found floating; the type keeps two libraries' dtypes from being compared
_FLOATING_SEEN: set[tuple[type, Any]] = set()


def iterable(
    grads: Any, where: str, name: str = "grads", example: str = "[p.grad for p in params]",
    items: str = "gradient arrays", one: str = "[grad]",
) -> list[Any]:
    """``grads`` as a list; TypeError naming ``where`` and ``name`` for None, one array, a non-iterable."""
    if grads is None or hasattr(grads, "shape") or not isinstance(grads, Iterable):
        what = f"one {type(grads).__module__}.{type(grads).__name__}" if grads is not None else "None"
        raise TypeError(f"{where} needs {name} to be a list of {items}, got {name}={what}. Fix: pass the "
                        f"list, e.g. {example} ({one} for a single one).")
    return list(grads)


def gradient_list(grads: Iterable[Any], where: str = "unscale_()") -> list[Any]:
    """The non-None gradients, refusing those that cannot change in place or are not floating-point."""
    grads = iterable(grads, where)
    arrays = [g for g in grads if g is not None]
    kinds = set(map(type, arrays))
    if any(issubclass(kind, _NOT_IN_PLACE) for kind in kinds):  # one check per type
        i, grad = next((i, g) for i, g in enumerate(grads) if isinstance(g, _NOT_IN_PLACE))
        if isinstance(grad, np.matrix):
            raise TypeError(f"grads[{i}] is a numpy.matrix, which the kernels cannot unscale in place. "
                            "Fix: pass np.asarray(m), an ndarray view of the same memory.")
        raise TypeError(f"grads[{i}] is a scalar ({type(grad).__module__}.{type(grad).__name__}, value "
                        f"{short_repr(grad)}), which cannot be changed in place, so it cannot be unscaled. "
                        "Fix: keep each gradient in an array (a 0-d array such as np.array(1.0, np.float32) "
                        "works), and pass that array.")
    check_floating(arrays, where)  # torch's meta device: at bind() and in the torch kernel's groups
    return arrays


def check_floating(arrays: list[Any], where: str) -> None:
    """Refuse integer, bool or complex gradients (a complex norm drops the imaginary part); objects
    without a dtype are left to the backend."""
    try:
        dtypes = set(map(_DTYPE, arrays))
    except (AttributeError, TypeError):  # not arrays, or unhashable dtypes: the backend refuses them
        return
    check_floating_dtypes(dtypes, arrays, where)


def check_floating_dtypes(dtypes: set[Any], arrays: list[Any], where: str) -> None:
    """:func:`check_floating` for a caller that has the set of ``arrays``' dtypes already."""
    for dtype in dtypes:
        key = (type(dtype), dtype)
        if key in _FLOATING_SEEN:
            continue
        if short_name(dtype) in FLOATING:
            _FLOATING_SEEN.add(key)  # a few dtypes: checked by name once each
        else:
            grad = next(a for a in arrays if a.dtype is dtype or a.dtype == dtype)
            raise ForeignArrayError(f"{where} got a gradient that is not floating-point ({describe(grad)}); "
                                    "loss scaling, norms and clipping work on real floating gradients only "
                                    "(float16, bfloat16, float32, float64). Fix: pass the gradients of "
                                    "floating parameters; keep integer, bool or complex arrays out of the "
                                    "list (for complex parameters, pass torch.view_as_real(p.grad)).")


def refuse_meta(arrays: list[Any], where: str) -> None:
    """Refuse torch ``meta`` tensors (no values): state built like them would live on meta."""
    grad = next((g for g in arrays if getattr(g, "is_meta", False) is True), None)
    if grad is not None:
        raise ConfigError(f"{where} got a tensor on torch's 'meta' device ({describe(grad)}), which holds no "
                          "values: nothing can be unscaled or checked, and the scaler's state would be "
                          "created on meta. Fix: materialize the model first (e.g. "
                          "model.to_empty(device='cpu') and initialize it), then pass its gradients.")


def describe(array: Any) -> str:
    """``torch.Tensor, shape (2, 3), dtype torch.int32``: what a message says about an array."""
    shape = getattr(array, "shape", None)
    text = f"{type(array).__module__}.{type(array).__name__}"
    if shape is not None:
        text += f", shape {tuple(shape)}"
    return text + f", dtype {getattr(array, 'dtype', '?')}"


def check_owned(arrays: list[Any], backend: Backend, where: str) -> None:
    """Refuse gradients of another library than the scaler's bound backend (one call per type)."""
    for kind in set(map(type, arrays)):
        grad = next(g for g in arrays if type(g) is kind)
        if not backend.accepts_array(grad):
            raise ForeignArrayError(f"{where} got a {describe(grad)}, but this scaler works on "
                                    f"{backend.name!r} arrays (its backend, chosen by "
                                    "backend=/POLYAMP_BACKEND or by the first arrays it saw). Fix: pass "
                                    f"{backend.name} arrays only, or use one scaler per array library.")


def check_outputs(outputs: Any, where: str = "outputs") -> None:
    """Refuse None, alone or inside lists/tuples: scaling it would silently do nothing."""
    if outputs is None:
        raise TypeError(f"scale() needs outputs to be an array or a list/tuple of arrays, got {where}=None. "
                        "Fix: pass the loss array, e.g. scaler.scale(loss).")
    if isinstance(outputs, (list, tuple)):
        for i, item in enumerate(outputs):
            check_outputs(item, f"{where}[{i}]")


def scale_value(value: Any) -> float:
    """A new scale as a checked float: a number, or a 1-element array read once (a sync on a GPU)."""
    if hasattr(value, "shape") and not isinstance(value, np.generic):
        shape = tuple(value.shape)
        if math.prod(shape) != 1:
            raise ConfigError("set_scale() needs value to be a number or a 1-element array, got an array of "
                              f"shape {shape}. Fix: pass e.g. value=65536.0.")
        if hasattr(value, "item"):
            value = value.item()
        else:  # strict array-API arrays have no methods
            import array_api_compat

            value = float(array_api_compat.array_namespace(value).reshape(value, ()))
    return check_scale("value", value)


def flag_value(found_inf: Any, backend: Backend | None, where: str = "update()", name: str = "found_inf"
               ) -> Any:
    """``found_inf`` as a host bool, or the array itself when ``backend`` (if bound) owns it."""
    if isinstance(found_inf, (bool, np.bool_)):
        return bool(found_inf)
    if not hasattr(found_inf, "shape"):
        raise TypeError(f"{where} needs {name} to be True/False or a flag array, got "
                        f"{name}={short_repr(found_inf)} ({type(found_inf).__name__}). Fix: pass "
                        f"{name}=True/False or a one-element flag array (non-zero: a bad step).")
    shape = tuple(found_inf.shape)
    if math.prod(shape) != 1:
        raise ConfigError(f"{where} needs {name} to be True/False or a one-element flag array, got an array "
                          f"of shape {shape}. Fix: pass the flag unscale_() returned, or reduce yours first "
                          "(e.g. flags.any()).")
    kind = str(getattr(found_inf, "dtype", "")).rsplit(".", 1)[-1]  # numpy's, torch's, paddle's names alike
    meta = getattr(found_inf, "is_meta", False)  # a meta tensor holds no value to read
    if not kind.startswith(("bool", "float", "int", "uint", "bfloat")) or meta:
        raise TypeError(f"{where} needs {name} to be True/False or a flag array of a real or bool dtype with "
                        f"values, got {name}={short_repr(found_inf)} (dtype {kind}). Fix: pass the flag "
                        "unscale_() returned (non-zero: a bad step), or True/False.")
    if backend is not None and not backend.owns_array(found_inf):
        raise ForeignArrayError(f"{where} got {name} of type "
                                f"{type(found_inf).__module__}.{type(found_inf).__name__}, which is not an "
                                f"array of the bound backend {backend.name!r}. Fix: pass the flag unscale_() "
                                "returned, or True/False.")
    return found_inf
