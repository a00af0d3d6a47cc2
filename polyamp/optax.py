"""Loss scaling as an optax ``GradientTransformation`` around an inner optimizer.

``tx = loss_scaled(optax.adam(1e-3))``; each step multiplies the loss by
``current_scale(opt_state)`` (or ``polyamp.functional.scale``) and hands the scaled gradients to
``tx.update``, which unscales them, skips the step on inf/nan (zero updates, the inner state kept)
and moves the scale: :mod:`polyamp.functional` under the hood, branch-free, so it runs under
``jax.jit``. Importing this module imports optax and jax; ``import polyamp`` does not.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from . import functional
from .config import LossScaleConfig
from .policy import LossScaleState

__all__ = ["LossScaledState", "current_scale", "loss_scaled"]


class LossScaledState(NamedTuple):
    """The state of :func:`loss_scaled`: the loss-scale state and the inner optimizer's state."""

    loss_scale: LossScaleState
    inner_state: Any


def loss_scaled(inner: optax.GradientTransformation, config: LossScaleConfig | None = None
                ) -> optax.GradientTransformationExtraArgs:
    """``inner`` fed unscaled gradients, skipping steps whose gradients overflowed.

    ``update(grads, state, params)`` takes the gradients of the loss times
    :func:`current_scale`; on an overflow the updates are zeros and the inner state is kept.
    Extra keyword arguments (``value=`` for ``reduce_on_plateau``, line searches) go to ``inner``
    as given: pass the unscaled loss as ``value``, since the scale moves.
    ``config`` is a :class:`polyamp.LossScaleConfig` (torch's defaults when None).
    """
    config = functional.config_or_default(config)
    if not (hasattr(inner, "init") and hasattr(inner, "update")):
        raise TypeError(
            f"inner must be an optax.GradientTransformation, got inner={inner!r}. "
            "Fix: pass an optax optimizer, e.g. loss_scaled(optax.adam(1e-3))"
        )

    def init_fn(params: Any) -> LossScaledState:
        leaves = jax.tree_util.tree_leaves(params)
        return LossScaledState(functional.init(config, like=leaves[0] if leaves else jnp.zeros(())),
                               inner.init(params))

    inner = optax.with_extra_args_support(inner)

    def update_fn(grads: Any, state: LossScaledState, params: Any = None, **extra_args: Any
                  ) -> tuple[Any, LossScaledState]:
        grads, found_inf = functional.unscale(state.loss_scale, grads)
        updates, inner_state = inner.update(grads, state.inner_state, params, **extra_args)
        zeros = jax.tree_util.tree_map(jnp.zeros_like, updates)
        updates = functional.where_finite(found_inf, updates, zeros)
        inner_state = functional.where_finite(found_inf, inner_state, state.inner_state)
        return updates, LossScaledState(functional.update(state.loss_scale, found_inf, config), inner_state)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def current_scale(opt_state: Any) -> Any:
    """The scale (a 0-d float32 array) to multiply the loss by, from :func:`loss_scaled`'s state
    (also inside the state of ``optax.chain``, ``named_chain``, ``multi_transform``, ``MultiSteps``)."""
    found = _find(opt_state)
    if found is None:
        raise TypeError(
            f"current_scale() needs the state of polyamp.optax.loss_scaled, got a "
            f"{type(opt_state).__name__} that holds none. Fix: pass tx.init(params)'s result, where "
            "tx = polyamp.optax.loss_scaled(optimizer)"
        )
    return found.loss_scale.scale


def _find(state: Any) -> LossScaledState | None:
    if isinstance(state, LossScaledState):
        return state
    if isinstance(state, (tuple, list, Mapping)):  # chain, MultiSteps; named_chain, multi_transform
        for part in state.values() if isinstance(state, Mapping) else state:
            found = _find(part)
            if found is not None:
                return found
    return None
