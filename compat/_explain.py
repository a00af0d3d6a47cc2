"""Named gradients for the facades' overflow reports: from a module, an optimizer, or as given.
Off the per-step path (``explain``, ``diagnose=True``); imports no framework.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from polyamp.adapters import iter_params
from polyamp.overflow import OverflowReport, named_arrays


def _readable(grad: Any) -> Any:
    """A sparse torch gradient as its values, a DTensor as this rank's shard (no collective)."""
    if getattr(grad, "is_sparse", False):
        return grad.coalesce().values()
    if callable(getattr(grad, "to_local", None)):
        return grad.to_local()
    return grad


def torch_named_grads(obj: Any, names: Mapping[int, str] | None = None) -> list[tuple[str, Any]]:
    """``(name, grad)`` of an ``nn.Module`` (``named_parameters()``), of an optimizer (``names``
    by parameter id, else ``param_groups[g][i]``), or of gradients as ``explain_overflow`` takes."""
    names = names or {}
    if callable(getattr(obj, "named_parameters", None)):
        pairs = [(name, p.grad) for name, p in obj.named_parameters()]
    elif isinstance(getattr(obj, "param_groups", None), list):
        pairs = [(names.get(id(p), f"param_groups[{g}][{i}]"), p.grad)
                 for g, group in enumerate(obj.param_groups) for i, p in enumerate(group["params"])]
    elif hasattr(obj, "step") and not isinstance(obj, Mapping):
        pairs = [(names.get(id(p), f"params[{i}]"), p.grad) for i, p in enumerate(iter_params(obj))]
    else:
        return named_arrays(obj)
    return [(name, _readable(g)) for name, g in pairs if g is not None]


def named_for_meter(grads: list[Any], optimizer: Any, names: Mapping[int, str] | None) -> Any:
    """``grads`` (an optimizer's, in its order) keyed by :func:`torch_named_grads`'s names where
    those name them one to one, else ``grads`` (the precision meter then names them by index)."""
    if optimizer is None:
        return grads
    keys = [name for name, _ in torch_named_grads(optimizer, names)]
    return dict(zip(keys, grads)) if len(keys) == len(grads) == len(set(keys)) else grads


def paddle_named_grads(obj: Any) -> list[tuple[str, Any]]:
    """``(param.name, grad)`` of a paddle Layer or optimizer (any object with parameters), or of
    gradients as ``explain_overflow`` takes them."""
    if isinstance(obj, Mapping) or not (callable(getattr(obj, "parameters", None)) or hasattr(obj, "step")
                                        or hasattr(obj, "_parameter_list")):
        return named_arrays(obj)
    pairs = []
    for i, param in enumerate(iter_params(obj)):
        read = getattr(param, "_grad_ivar", None)  # paddle: param.grad is a new wrapper per read
        grad = read() if callable(read) else getattr(param, "grad", None)
        if grad is not None:
            pairs.append((getattr(param, "name", None) or f"params[{i}]", grad))
    return pairs


def writes_zeros(backend: Any, keep: bool) -> bool:
    """Whether ``backend``'s unscale kernel writes ``grad * 0`` on an overflow (paddle's fused kernel:
    inf becomes NaN, finite values 0), unless ``keep`` (``diagnose=True``) chose the one that keeps them."""
    return (not keep and backend is not None
            and backend.unscale_and_check_keep is not backend.unscale_and_check)


def zeroed_note(report: OverflowReport, obj: Any, zeroing: set[int]) -> OverflowReport:
    """``report`` saying so where its non-finite gradients are what an unscale kernel left (``grad * 0``:
    each inf or nan reads as NaN, every finite value as 0), not the values the backward wrote."""
    if not report.tensors or not zeroing or isinstance(obj, Mapping):
        return report
    if not any(id(p) in zeroing for p in iter_params(obj)):
        return report
    note = ("these gradients were already unscaled (unscale_ or step) by paddle's kernel, which on an "
            "overflow writes grad * 0: each inf or nan now reads as NaN and every finite value as 0, so the "
            "counts above are of what it left, not of the values the backward wrote. Fix: build the "
            "scaler with diagnose=True to keep them (the report on a skipped step then sees them too), or "
            "call explain(optimizer) before unscale_. ")
    return dataclasses.replace(report, diagnosis=note + report.diagnosis)
