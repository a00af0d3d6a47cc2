"""Named gradients for the facades' overflow reports: from a module, an optimizer, or as given.

Read-only and called only by ``explain`` and after a skipped step with ``diagnose=True``
(a loop per parameter is fine there; the per-step path never comes here). Imports no framework.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from polyamp.adapters import iter_params
from polyamp.overflow import named_arrays


def _readable(grad: Any) -> Any:
    """A sparse torch gradient as its values (a new tensor; the gradient is not changed), a
    DTensor as this rank's shard (no collective: each rank reports its own values)."""
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
