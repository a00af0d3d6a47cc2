"""The loss-scale rule, once in plain Python and once as branch-free array code.

The rule (``backoff_interval=1`` is torch's ``_amp_update_scale_``; ``backoff_interval=n``
is paddle's ``decr_every_n_nan_or_inf=n`` with ``incr_every_n_steps=growth_interval``)::

    on overflow (found_inf): growth_tracker = 0; backoff_tracker += 1
        if backoff_tracker == backoff_interval:
            scale = max(scale * backoff_factor, floor); backoff_tracker = 0
    on a finite step:        backoff_tracker = 0; growth_tracker += 1
        if growth_tracker == growth_interval:
            new = scale * growth_factor
            if new is finite: scale = min(new, max_scale)
            growth_tracker = 0

``floor`` is ``min_scale`` when set, else ``SCALE_FLOOR`` (2**-126, float32's smallest normal):
the scale never becomes subnormal or 0, which torch's rule allows and which turns the unscaled
gradients into NaN. Products are formed in ``config.product_dtype`` (float64 for torch, float32
for paddle) and rounded to float32. With ``dynamic=False`` the state never changes. Backends' device
kernels must agree with :func:`next_host_state`; the tests hold each one against it.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from .config import SCALE_FLOOR, LossScaleConfig


class LossScaleState(NamedTuple):
    """The scaler's device state: three 0-d arrays (scale float32, trackers int32)."""

    scale: Any
    growth_tracker: Any
    backoff_tracker: Any


class HostState(NamedTuple):
    """The same state as Python numbers, for the readable rule and for checkpoints."""

    scale: float
    growth_tracker: int = 0
    backoff_tracker: int = 0


def _product(scale: float, factor: float, config: LossScaleConfig) -> float:
    """scale * factor formed in the configured precision, rounded to float32 (inf past its max)."""
    with np.errstate(over="ignore"):  # growth past float32's max is expected; the rule checks it
        if config.product_dtype == "float32":
            return float(np.float32(scale) * np.float32(factor))
        return float(np.float32(float(scale) * float(factor)))


def _float32(value: float) -> float:
    """``value`` rounded to float32; a bound beyond float32's range becomes inf (no bound)."""
    with np.errstate(over="ignore"):
        return float(np.float32(value))


def scale_floor(config: LossScaleConfig) -> float:
    """The lowest scale a backoff may leave: ``min_scale`` (as float32) when set, else SCALE_FLOOR.

    The config refuses a ``min_scale`` below SCALE_FLOOR, so this is ``max(min_scale, SCALE_FLOOR)``.
    """
    if config.min_scale is None:
        return SCALE_FLOOR
    return max(_float32(config.min_scale), SCALE_FLOOR)


def next_host_state(state: HostState, found_inf: bool, config: LossScaleConfig) -> HostState:
    """One update of the rule on Python numbers; the reference every kernel must match."""
    if not config.dynamic:
        return state
    scale, growth, backoff = state
    if found_inf:
        growth, backoff = 0, backoff + 1
        if backoff == config.backoff_interval:
            scale = max(_product(scale, config.backoff_factor, config), scale_floor(config))
            backoff = 0
        return HostState(scale, growth, backoff)
    growth, backoff = growth + 1, 0
    if growth == config.growth_interval:
        new = _product(scale, config.growth_factor, config)
        if np.isfinite(new):
            if config.max_scale is not None:
                new = min(new, _float32(config.max_scale))
            scale = new
        growth = 0
    return HostState(scale, growth, backoff)


def next_state(
    state: LossScaleState, found_inf: Any, config: LossScaleConfig, xp: Any
) -> LossScaleState:
    """The rule as branch-free array code (``xp.where``): new arrays, no host read.

    ``found_inf`` is a 0-d float32 array, non-zero when some gradient overflowed. ``xp`` is an
    array-API namespace; works with immutable arrays (it never writes in place).
    """
    if not config.dynamic:
        return state
    scale, growth, backoff = state
    found = found_inf != 0
    backoff_next = xp.where(found, backoff + 1, xp.zeros_like(backoff))
    growth_next = xp.where(found, xp.zeros_like(growth), growth + 1)
    do_backoff = found & (backoff_next == config.backoff_interval)
    do_grow = ~found & (growth_next == config.growth_interval)

    wide = xp.float32 if config.product_dtype == "float32" else xp.float64
    scale_w = xp.astype(scale, wide)
    backed = xp.astype(scale_w * float(config.backoff_factor), xp.float32)  # float: an int 10**30
    # factor would not convert to a float32 tensor scalar (torch: "int too big to convert")
    backed = xp.maximum(backed, xp.asarray(scale_floor(config), dtype=xp.float32))
    grown = xp.astype(scale_w * float(config.growth_factor), xp.float32)
    grow_ok = do_grow & xp.isfinite(grown)
    if config.max_scale is not None:
        grown = xp.minimum(grown, xp.asarray(config.max_scale, dtype=xp.float32))

    new_scale = xp.where(do_backoff, backed, xp.where(grow_ok, grown, scale))
    new_backoff = xp.where(do_backoff, xp.zeros_like(backoff), backoff_next)
    new_growth = xp.where(do_grow, xp.zeros_like(growth), growth_next)
    return LossScaleState(new_scale, new_growth, new_backoff)
