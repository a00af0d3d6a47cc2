"""Finding an optimizer's parameters and gradients, whatever framework wrote the optimizer.

Recognised, first that applies: torch-style ``param_groups`` (torch optimizers, polyamp's
own), paddle-style ``_param_groups`` / ``_parameter_list``, or a ``parameters()`` method.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any


def iter_params(optimizer: Any) -> Iterator[Any]:
    """Every parameter the optimizer updates, in its own order."""
    groups = getattr(optimizer, "param_groups", None)
    if groups is not None:
        for group in groups:
            yield from group["params"]
        return
    groups = getattr(optimizer, "_param_groups", None)
    if groups:
        for group in groups:
            yield from (group["params"] if isinstance(group, dict) else [group])
        return
    params = getattr(optimizer, "_parameter_list", None)
    if params is not None:
        yield from params
        return
    if callable(getattr(optimizer, "parameters", None)):
        yield from optimizer.parameters()
        return
    raise TypeError(f"cannot find the parameters of optimizer={type(optimizer).__name__}: expected "
                    "torch-style param_groups, paddle-style _param_groups/_parameter_list, or parameters()")

