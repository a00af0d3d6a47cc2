"""The moving parts of the paddle facade: optimizer stages, gradients, the optimizer call, logging."""

from __future__ import annotations

import logging
from enum import Enum
from typing import Any

from polyamp.adapters import iter_params
from polyamp.policy import HostState

logger = logging.getLogger("polyamp")


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


def apply_optimizer(optimizer: Any, args: tuple, kwargs: dict) -> Any:
    """``optimizer.minimize(*args, **kwargs)``'s result as it is (paddle's is a pair), or, where
    there is no ``minimize``, ``step()`` and paddle's pair ``([], [(param, grad), ...])``."""
    if callable(getattr(optimizer, "minimize", None)):
        return optimizer.minimize(*args, **kwargs)
    optimizer.step()
    return [], param_grad_pairs(optimizer)


def log_change(before: HostState, after: HostState, found: bool, config: Any, detail: str = "") -> None:
    """Say on the ``polyamp`` logger how the scale moved (paddle prints only its decreases).

    Overflows at INFO; growth, routine in a healthy run, at DEBUG (importing paddle turns INFO on).
    ``detail``: appended to an overflow's line (the overflow report's summary, or "").
    """
    if found and after.scale != before.scale:
        logger.info("Found inf or nan in gradients: loss scale decreased %g -> %g (decr_ratio=%g)%s",
                    before.scale, after.scale, config.backoff_factor, detail)
    elif found and after.backoff_tracker:
        logger.info("Found inf or nan in gradients: loss scale kept at %g (overflow %d of "
                    "decr_every_n_nan_or_inf=%d)%s", after.scale, after.backoff_tracker,
                    config.backoff_interval, detail)
    elif found:
        logger.info("Found inf or nan in gradients: loss scale kept at min_scale=%g%s", after.scale, detail)
    elif after.scale != before.scale:
        logger.debug("loss scale increased %g -> %g after %d finite steps (incr_every_n_steps)",
                     before.scale, after.scale, config.growth_interval)
