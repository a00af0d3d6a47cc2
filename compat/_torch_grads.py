"""An optimizer's gradients, with torch.amp.GradScaler's checks, in as few passes as possible: ``.grad``
read once per parameter, one set of dtypes for the FP16 rule, grouping left to the backend's C++ pass.
"""

from __future__ import annotations

from operator import attrgetter
from typing import Any

from polyamp._errors import ForeignArrayError
from polyamp._inputs import check_floating_dtypes
from polyamp.adapters import iter_params
from polyamp.backend import Backend

# (dtype type, dtype) -> is it float16. Keyed by the type too, so a lookup never compares the dtypes
# of two libraries (array-api-strict warns when one is compared).
_FP16: dict[tuple[type, Any], bool] = {}
_CHECKED: dict[tuple[type, Any], bool] = {}  # as _FP16, of the floating dtypes already checked

_GRAD, _DTYPE = attrgetter("grad"), attrgetter("dtype")


def is_fp16(array_or_dtype: Any) -> bool:
    """Whether an array (or a dtype) is IEEE float16: torch.float16 or numpy/cupy float16."""
    dtype = getattr(array_or_dtype, "dtype", array_or_dtype)
    key = (type(dtype), dtype)
    known = _FP16.get(key)
    if known is None:
        known = _FP16[key] = str(dtype).rsplit(".", 1)[-1] == "float16"
    return known


def param_groups(optimizer: Any) -> list[Any]:
    """The optimizer's param groups (one group of its parameters where it has none)."""
    groups = getattr(optimizer, "param_groups", None)
    return groups if isinstance(groups, list) else [{"params": list(iter_params(optimizer))}]


def _params(optimizer: Any) -> list[Any]:
    """The optimizer's parameters in order."""
    return [p for group in param_groups(optimizer) for p in group["params"]]


def _all_grads(optimizer: Any) -> list[Any]:
    groups = getattr(optimizer, "param_groups", None)
    try:
        if isinstance(groups, list):  # map with attrgetter: the per-parameter loop runs in C
            return [g for group in groups for g in map(_GRAD, group["params"])]
        return list(map(_GRAD, iter_params(optimizer)))
    except AttributeError:  # torch's AssertionError, naming the offending type
        bad = next(p for p in _params(optimizer) if not hasattr(p, "grad"))
        raise AssertionError(
            f"expected param to be torch.Tensor, got {type(bad).__name__} (polyamp also accepts "
            "any array parameter with a .grad attribute, such as polyamp.Parameter)"
        ) from None


def _library_name(kind: type) -> str:
    """``numpy.ndarray``, ``torch.Tensor``, ``cupy.ndarray``: the library and the type."""
    return f"{kind.__module__.partition('.')[0]}.{kind.__name__}"


def check_one_library(grads: list[Any], backend: Backend) -> None:
    """ForeignArrayError unless every gradient is of one array library that ``backend`` holds
    (one pass over the types, in C, and one ``accepts_array`` call per step)."""
    kinds = set(map(type, grads))
    if len(kinds) == 1 and backend.accepts_array(grads[0]):
        return
    names = sorted({_library_name(kind) for kind in kinds})
    if len({name.partition(".")[0] for name in names}) > 1:
        raise ForeignArrayError(
            f"one optimizer holds parameters of more than one array library: its gradients "
            f"are {' and '.join(names)}, and a GradScaler unscales the arrays of one library. "
            "Fix: one optimizer per array library, each with its own GradScaler "
            "(a scaler keeps its scale in one library: backend= or its first scale() call's)."
        )
    foreign = next(g for g in grads if not backend.accepts_array(g))
    raise ForeignArrayError(
        f"the optimizer's gradients are {' and '.join(names)}, but this GradScaler keeps its "
        f"scale in backend {backend.name!r} (chosen by backend= or its first scale() call), "
        f"which cannot hold a {_library_name(type(foreign))}. Fix: one GradScaler per array "
        "library, each scaling that library's loss."
    )


def collect_grads(optimizer: Any, allow_fp16: bool, backend: Backend) -> list[Any]:
    """The non-None gradients of ``optimizer``; ValueError on FP16 unless ``allow_fp16``,
    ForeignArrayError unless all are arrays of one library that ``backend`` holds. Every check
    comes before anything is changed."""
    grads = [g for g in _all_grads(optimizer) if g is not None]
    if not grads:
        return grads
    check_one_library(grads, backend)
    fp16 = False
    for dtype in set(map(_DTYPE, grads)):
        known = _CHECKED.get((type(dtype), dtype))
        if known is None:  # a dtype not seen yet: checked floating once (so the iteration need not)
            check_floating_dtypes({dtype}, grads, "unscale_()")
            known = _CHECKED[(type(dtype), dtype)] = is_fp16(dtype)
        fp16 = fp16 or known
    if fp16:
        if not allow_fp16:
            raise ValueError("Attempting to unscale FP16 gradients.")
        for param in _params(optimizer):  # torch's rule: sparse FP16 gradients checked coalesced
            grad = param.grad  # (duplicate indices summed in FP16 can overflow)
            if grad is not None and getattr(grad, "is_sparse", False) and is_fp16(grad):
                param.grad = grad.coalesce()
        grads = [g for g in _all_grads(optimizer) if g is not None]
    return grads
