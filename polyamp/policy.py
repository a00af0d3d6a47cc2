"""The loss-scale rules, once in plain Python and once as branch-free array code.

One rule with three parameters (:class:`RuleParams`) covers the four ``config.rule`` values
(docs/rule.md states each engine's update and how it maps here)::

    on overflow (found_inf): growth_tracker = 0; backoff_tracker += 1
        if backoff_tracker >= backoff_interval:
            scale = max(scale * backoff_factor, floor)
            backoff_tracker = backoff_interval - 1 if keeps_count else 0
    on a finite step:
        if finite_refills: backoff_tracker = 0           # torch, paddle, deepspeed+consecutive
        growth_tracker += 1
        if growth_tracker >= growth_interval + growth_delay:
            new = scale * growth_factor
            if new is finite: scale = min(new, max_scale)
            growth_tracker = growth_delay; backoff_tracker = 0

``keeps_count`` (megatron, deepspeed): a spent hysteresis stays spent until a refill. ``growth_delay``
is 1 for deepspeed (its window starts after the first finite step). ``floor`` is ``min_scale``, else
``SCALE_FLOOR`` (2**-126; torch allows subnormals and 0). Products are formed in ``config.products``,
rounded to float32; ``dynamic=False`` never moves. ``>=`` where the engines write ``==``: the same
within :func:`tracker_limits`, where every backend kernel must agree with :func:`next_host_state`.
"""

from __future__ import annotations

import struct
from typing import Any, NamedTuple

import numpy as np

from .config import SCALE_FLOOR, LossScaleConfig


class LossScaleState(NamedTuple):
    """The scaler's device state: three 0-d arrays (scale float32, trackers int32)."""

    scale: Any
    growth_tracker: Any
    backoff_tracker: Any


class RuleParams(NamedTuple):
    """What distinguishes the rules: see the module docstring."""

    keeps_count: bool
    finite_refills: bool
    growth_delay: int


def rule_params(config: LossScaleConfig) -> RuleParams:
    """The parameters of ``config.rule`` (and DeepSpeed's ``consecutive_hysteresis``)."""
    if config.rule == "megatron":
        return RuleParams(keeps_count=True, finite_refills=False, growth_delay=0)
    if config.rule == "deepspeed":
        return RuleParams(keeps_count=True, finite_refills=config.consecutive_hysteresis, growth_delay=1)
    return RuleParams(keeps_count=False, finite_refills=True, growth_delay=0)


def tracker_limits(config: LossScaleConfig) -> tuple[int, int]:
    """The largest growth and backoff trackers the rule leaves (inclusive), for checkpoints."""
    params = rule_params(config)
    return config.growth_interval - 1 + params.growth_delay, config.backoff_interval - 1


class HostState(NamedTuple):
    """The same state as Python numbers, for the readable rule and for checkpoints."""

    scale: float
    growth_tracker: int = 0
    backoff_tracker: int = 0


def fit_to_config(state: HostState, config: LossScaleConfig) -> HostState:
    """``state`` with its trackers cut to :func:`tracker_limits`, for a config that shortened an
    interval: the same trajectory under the rule, and kernels comparing ``==`` agree with it."""
    most_growth, most_backoff = tracker_limits(config)
    return HostState(state.scale, min(state.growth_tracker, most_growth),
                     min(state.backoff_tracker, most_backoff))


def _product(scale: float, factor: float, config: LossScaleConfig) -> float:
    """scale * factor formed in the configured precision, rounded to float32 (inf past its max)."""
    with np.errstate(over="ignore"):  # growth past float32's max is expected; the rule checks it
        if config.products == "float32":
            return float(np.float32(scale) * np.float32(factor))
        return float(np.float32(float(scale) * float(factor)))


def _float32(value: float) -> float:
    """``value`` rounded to float32; a bound beyond float32's range becomes inf (no bound)."""
    with np.errstate(over="ignore"):
        return float(np.float32(value))


def scale_floor(config: LossScaleConfig) -> float:
    """The lowest scale a backoff may leave: ``min_scale`` (as float32) when set, else SCALE_FLOOR."""
    return SCALE_FLOOR if config.min_scale is None else max(_float32(config.min_scale), SCALE_FLOOR)


def backs_off_at_floor(state: HostState, config: LossScaleConfig) -> bool:
    """Whether an overflow now would back off a scale already at its floor (DeepSpeed's
    ``raise_error_at_min_scale`` condition: ``cur_scale == min_scale`` when hysteresis is spent)."""
    spent = state.backoff_tracker + 1 == config.backoff_interval
    return config.dynamic and spent and _float32(state.scale) == scale_floor(config)


def next_host_state(state: HostState, found_inf: bool, config: LossScaleConfig) -> HostState:
    """One update of the rule on Python numbers; the reference every kernel must match."""
    if not config.dynamic:
        return state
    params = rule_params(config)
    scale, growth, backoff = state
    if found_inf:
        growth, backoff = 0, backoff + 1
        if backoff >= config.backoff_interval:  # >=: a state past the limit is spent, not stuck
            scale = max(_product(scale, config.backoff_factor, config), scale_floor(config))
            backoff = config.backoff_interval - 1 if params.keeps_count else 0  # spent stays spent
        return HostState(scale, growth, backoff)
    growth = growth + 1
    if params.finite_refills:
        backoff = 0
    if growth >= config.growth_interval + params.growth_delay:
        new = _product(scale, config.growth_factor, config)
        if np.isfinite(new):
            if config.max_scale is not None:
                new = min(new, _float32(config.max_scale))
            scale = new
        growth, backoff = params.growth_delay, 0
    return HostState(scale, growth, backoff)


#: The int32 trackers' largest value: a limit past it is never reached.
_TRACKER_MAX = 2**31 - 1


def _reaches(tracker: Any, limit: int) -> Any:
    """``tracker >= limit`` (>=: see :func:`next_host_state`); never for a limit past int32's range,
    which torch would wrap to int32 before comparing (2**32 + 3 compared as 3)."""
    if limit > _TRACKER_MAX:
        return tracker != tracker  # all False, as the tracker's bool array
    return tracker >= limit


def next_state(
    state: LossScaleState, found_inf: Any, config: LossScaleConfig, xp: Any, *, products: str | None = None
) -> LossScaleState:
    """The rule as branch-free array code (``xp.where``): new arrays, no host read, never in place.
    ``products`` overrides ``config.products`` for a library without float64 (JAX without x64)."""
    if not config.dynamic:
        return state
    params = rule_params(config)
    scale, growth, backoff = state
    found = found_inf != 0
    zeros = xp.zeros_like(backoff)
    counted = backoff + 1
    growth_next = growth + 1
    do_backoff = found & _reaches(counted, config.backoff_interval)
    do_grow = ~found & _reaches(growth_next, config.growth_interval + params.growth_delay)

    wide = xp.float32 if (products or config.products) == "float32" else xp.float64
    scale_w = xp.astype(scale, wide)
    # float(): an int factor of 10**30 is "too big to convert" to a torch float32 scalar
    backed = xp.astype(scale_w * float(config.backoff_factor), xp.float32)
    backed = xp.maximum(backed, xp.asarray(scale_floor(config), dtype=xp.float32))
    grown = xp.astype(scale_w * float(config.growth_factor), xp.float32)
    grow_ok = do_grow & xp.isfinite(grown)
    if config.max_scale is not None:
        grown = xp.minimum(grown, xp.asarray(config.max_scale, dtype=xp.float32))

    new_scale = xp.where(do_backoff, backed, xp.where(grow_ok, grown, scale))
    spent = zeros + min(config.backoff_interval - 1, _TRACKER_MAX) if params.keeps_count else zeros
    on_found = xp.where(do_backoff, spent, counted)
    on_finite = zeros if params.finite_refills else xp.where(do_grow, zeros, backoff)
    new_backoff = xp.where(found, on_found, on_finite)
    growth_zeros = xp.zeros_like(growth)
    restart = growth_zeros + params.growth_delay if params.growth_delay else growth_zeros  # deepspeed: 1
    new_growth = xp.where(found, growth_zeros, xp.where(do_grow, restart, growth_next))
    return LossScaleState(new_scale, new_growth, new_backoff)


def scale_bits(scale: float) -> int:
    """The float32 bit pattern of ``scale`` (what the fingerprint carries)."""
    return _U32.unpack(_F32.pack(scale))[0]


_F32, _U32 = struct.Struct("<f"), struct.Struct("<I")
