"""The moving parts of the paddle facade: optimizer stages, gradients, the optimizer call, log lines."""

from __future__ import annotations

from enum import Enum
from typing import Any

from polyamp.adapters import iter_params
from polyamp.policy import HostState


class OptimizerState(Enum):
    """Where one optimizer is in the iteration, as in paddle."""

    INIT = 0
    UNSCALED = 1
    STEPPED = 2


def param_grad_pairs(optimizer: Any) -> list[tuple[Any, Any]]:
    """(param, grad) for each parameter with a gradient; for paddle ones the real grad tensor."""
    pairs = []
    for param in iter_params(optimizer):
        read = getattr(param, "_grad_ivar", None)  # paddle: param.grad is a new wrapper per read
        grad = read() if callable(read) else param.grad
        if grad is not None:
            pairs.append((param, grad))
    return pairs


def named_by_param(pairs: list[tuple[Any, Any]], grads: list[Any]) -> Any:
    """``grads`` (of ``pairs``, in order) keyed by each parameter's ``param.name`` (``params[i]`` where
    it has none) when those names are distinct, else ``grads`` as they are (then named by index)."""
    names = [getattr(param, "name", None) or f"params[{i}]" for i, (param, _) in enumerate(pairs)]
    return dict(zip(names, grads)) if len(set(names)) == len(names) else grads


def apply_optimizer(optimizer: Any, args: tuple, kwargs: dict) -> Any:
    """``optimizer.minimize(*args, **kwargs)``'s result as it is (paddle's is a pair), or, where
    there is no ``minimize``, ``step()`` and paddle's pair ``([], [(param, grad), ...])``."""
    if callable(getattr(optimizer, "minimize", None)):
        return optimizer.minimize(*args, **kwargs)
    optimizer.step()
    return [], param_grad_pairs(optimizer)


def describe_change(found: bool, before: HostState, after: HostState, config: Any) -> str | None:
    """How the scale moved, in paddle's words; None: it did not (``polyamp._skip_log`` picks the level)."""
    if found and after.scale != before.scale:
        return (f"Found inf or nan in gradients: loss scale decreased {before.scale:g} -> {after.scale:g} "
                f"(decr_ratio={config.backoff_factor:g})")
    if found and after.backoff_tracker:
        return (f"Found inf or nan in gradients: loss scale kept at {after.scale:g} (overflow "
                f"{after.backoff_tracker} of decr_every_n_nan_or_inf={config.backoff_interval})")
    if found:
        return f"Found inf or nan in gradients: loss scale kept at min_scale={after.scale:g}"
    if after.scale != before.scale:
        return (f"loss scale increased {before.scale:g} -> {after.scale:g} after "
                f"{config.growth_interval} finite steps (incr_every_n_steps)")
    return None
