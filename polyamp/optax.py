"""Loss scaling as an optax ``GradientTransformation`` around an inner optimizer.

``tx = loss_scaled(optax.adam(1e-3))``; multiply the loss by ``current_scale(opt_state)`` and
``tx.update`` unscales, skips on inf/nan and moves the scale, branch-free (:mod:`polyamp.functional`).
Importing this module imports optax and jax; ``import polyamp`` does not.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from . import functional
from ._errors import ConfigError
from .config import LossScaleConfig
from .policy import LossScaleState

__all__ = ["LossScaledState", "current_scale", "loss_scaled", "skip_count", "skipped"]


class LossScaledState(NamedTuple):
    """The state of :func:`loss_scaled`: the loss-scale state, the inner optimizer's state, whether
    the last update was skipped (0-d bool) and how many updates were skipped (0-d int32)."""

    loss_scale: LossScaleState
    inner_state: Any
    skipped: Any
    skips: Any


def loss_scaled(inner: optax.GradientTransformation, config: LossScaleConfig | None = None
                ) -> optax.GradientTransformationExtraArgs:
    """``inner`` fed unscaled gradients, skipping steps whose gradients overflowed (zero updates,
    the inner state kept). Extra keyword arguments go to ``inner`` (pass an unscaled ``value=``).
    Accumulate inside: ``loss_scaled(optax.MultiSteps(inner, k))`` (the other order keeps NaN).
    """
    config = functional.config_or_default(config)
    if not (hasattr(inner, "init") and hasattr(inner, "update")):
        raise TypeError(f"inner must be an optax.GradientTransformation, got inner={inner!r}. "
                        "Fix: pass an optax optimizer, e.g. loss_scaled(optax.adam(1e-3))")

    def init_fn(params: Any) -> LossScaledState:
        leaves = jax.tree_util.tree_leaves(params)
        loss_scale = functional.init(config, like=leaves[0] if leaves else jnp.zeros(()))
        return LossScaledState(loss_scale, inner.init(params), jnp.zeros((), jnp.bool_),
                               jnp.zeros((), jnp.int32))

    inner = optax.with_extra_args_support(inner)

    def update_fn(grads: Any, state: LossScaledState, params: Any = None, **extra_args: Any
                  ) -> tuple[Any, LossScaledState]:
        grads, found_inf = functional.unscale(state.loss_scale, grads)
        updates, inner_state = inner.update(grads, state.inner_state, params, **extra_args)
        zeros = jax.tree_util.tree_map(jnp.zeros_like, updates)
        updates = functional.where_finite(found_inf, updates, zeros)
        inner_state = functional.where_finite(found_inf, inner_state, state.inner_state)
        skipped = found_inf != 0
        skips = state.skips + (skipped & (state.skips < functional._INT32_MAX)).astype(jnp.int32)
        return updates, LossScaledState(functional.update(state.loss_scale, found_inf, config), inner_state,
                                        skipped, skips)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def current_scale(opt_state: Any) -> Any:
    """The scale (a 0-d float32 array) to multiply the loss by, from :func:`loss_scaled`'s state
    (also nested in ``optax.chain``, ``multi_transform`` and the like)."""
    return _find(opt_state, "current_scale").loss_scale.scale


def skipped(opt_state: Any) -> Any:
    """Whether :func:`loss_scaled`'s last update was skipped (its gradients held inf/nan): 0-d bool."""
    return _find(opt_state, "skipped").skipped


def skip_count(opt_state: Any) -> Any:
    """How many of :func:`loss_scaled`'s updates were skipped (0-d int32, saturating)."""
    return _find(opt_state, "skip_count").skips


def _find(state: Any, caller: str) -> LossScaledState:
    """The one :class:`LossScaledState` in ``state``; none, two, or one under MultiSteps refused."""
    found = list(_walk(state, "opt_state", None))
    if not found:
        raise TypeError(f"{caller}() needs the state of polyamp.optax.loss_scaled, got a "
                        f"{type(state).__name__} that holds none. Fix: pass tx.init(params)'s "
                        "result, where tx = polyamp.optax.loss_scaled(optimizer)")
    for path, _, multi_steps in found:
        if multi_steps is not None:
            raise ConfigError(f"{caller}() found polyamp.optax.loss_scaled's state at {path}, inside "
                              f"optax.MultiSteps' state (at {multi_steps}): MultiSteps accumulates the "
                              "scaled gradients, so after one overflow its accumulator holds NaN (0 * inf) "
                              "and every later step is skipped. Fix: accumulate inside the loss scaling, "
                              "polyamp.optax.loss_scaled(optax.MultiSteps(optimizer, every_k_schedule=k))")
    if len(found) > 1:
        paths = ", ".join(path for path, _, _ in found)
        raise ConfigError(f"{caller}() found {len(found)} polyamp.optax.loss_scaled states "
                          f"in opt_state, at {paths}: one loss carries one scale, so which "
                          "one is meant is unclear. Fix: wrap the whole optimizer in one "
                          "loss_scaled (e.g. loss_scaled(optax.multi_transform(...))), or "
                          f"pass the part you mean, e.g. {caller}({found[0][0]})")
    return found[0][1]


def _walk(state: Any, path: str, multi_steps: str | None
          ) -> Iterator[tuple[str, LossScaledState, str | None]]:
    """``(path, state, path of an enclosing MultiSteps state or None)`` for each LossScaledState."""
    if isinstance(state, LossScaledState):
        yield path, state, multi_steps
        state = state.inner_state  # a loss_scaled nested in another is a second scale
        path = f"{path}.inner_state"
    if isinstance(state, optax.MultiStepsState) and multi_steps is None:
        multi_steps = path
    if isinstance(state, Mapping):  # named_chain, multi_transform
        for key, part in state.items():
            yield from _walk(part, f"{path}[{key!r}]", multi_steps)
    elif isinstance(state, tuple) and hasattr(state, "_fields"):  # optax's NamedTuple states
        for name, part in zip(state._fields, state):
            yield from _walk(part, f"{path}.{name}", multi_steps)
    elif isinstance(state, (tuple, list)):  # chain
        for i, part in enumerate(state):
            yield from _walk(part, f"{path}[{i}]", multi_steps)
