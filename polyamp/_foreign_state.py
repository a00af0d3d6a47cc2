"""Megatron-Core's ``DynamicGradScaler.state_dict()`` and DeepSpeed's ``DynamicLossScaler`` ``vars()``,
read as polyamp's with ``rule="megatron"`` / ``"deepspeed"`` (docs/rule.md). The scaler's own config
gives what the layout lacks; a setting the layout holds must equal it. Counters and guard history stay.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Mapping
from typing import Any

from ._errors import ConfigError, StateDictError
from .config import SCALE_CEILING, SCALE_FLOOR, LossScaleConfig, short_repr

MEGATRON = frozenset({"scale", "growth_tracker", "hysteresis_tracker"})
DEEPSPEED = frozenset({"cur_scale", "cur_iter", "last_overflow_iter"})

#: DeepSpeed's settings beside its state, and how each reads from a config.
_DEEPSPEED_SETTINGS = {
    "scale_window": lambda c: c.growth_interval,
    "delayed_shift": lambda c: c.backoff_interval,
    "consecutive_hysteresis": lambda c: c.consecutive_hysteresis,
    "raise_error_at_min_scale": lambda c: c.raise_error_at_min_scale,
    "scale_factor": lambda c: c.growth_factor if c.growth_factor * c.backoff_factor == 1.0 else None,
    "min_scale": lambda c: c.min_scale,
}


def layout(state: Any) -> str | None:
    """ "megatron" or "deepspeed" when ``state`` is that library's scaler state, else None."""
    if not isinstance(state, Mapping) or "format" in state:
        return None
    keys = set(state)
    if MEGATRON <= keys and not keys & {"growth_factor", "_growth_tracker"}:  # not torch's
        return "megatron"
    if DEEPSPEED <= keys:
        return "deepspeed"
    return None


def to_polyamp(state: Mapping[str, Any], current: dict[str, Any]) -> dict[str, Any]:
    """``state`` (a :func:`layout`) as a polyamp state dict, from ``current`` (the scaler's
    ``state_now()``); StateDictError naming the key."""
    which = layout(state)
    where = f"{'Megatron-Core' if which == 'megatron' else 'DeepSpeed'} scaler state"
    config = _config(LossScaleConfig.from_dict(dict(current["config"])), which, where)
    scale, growth, backoff = (_megatron if which == "megatron" else _deepspeed)(state, config, where)
    return {**current, "config": config.to_dict(), "scale": scale, "growth_tracker": growth,
            "backoff_tracker": backoff}


def _config(config: LossScaleConfig, rule: str, where: str) -> LossScaleConfig:
    """The scaler's config with the layout's rule (DeepSpeed's options only with its own)."""
    if rule == config.rule:
        return config
    try:
        if rule == "megatron" and (config.consecutive_hysteresis or config.raise_error_at_min_scale):
            raise ConfigError("the scaler's config sets DeepSpeed's consecutive_hysteresis/"
                              "raise_error_at_min_scale, which Megatron's rule has not")
        return config.replace(rule=rule)
    except ConfigError as exc:
        raise StateDictError(
            f"a {where} is read with rule={rule!r}, which this scaler's config cannot take ({exc}). Fix: "
            f"build the scaler with LossScaleConfig(rule={rule!r}, ...) and that run's settings "
            "(docs/rule.md), then load it; the scaler is unchanged."
        ) from None


def _number(state: Mapping[str, Any], key: str, where: str) -> float | int:
    """``state[key]`` as a Python number (a 1-element tensor or NumPy value by ``.item()``)."""
    value = state[key]
    if not isinstance(value, (bool, int, float)) and callable(getattr(value, "item", None)):
        with contextlib.suppress(ValueError, RuntimeError):  # more than one value: refused below
            value = value.item()  # Megatron's scale: a float32 tensor of shape [1]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise StateDictError(f"{where}[{key!r}] must be a number, got {key}={short_repr(value)}. Fix: "
                             "load the dict that library's scaler wrote, unchanged.")
    return value


def _int(state: Mapping[str, Any], key: str, where: str, low: int, high: int, why: str) -> int:
    value = _number(state, key, where)
    if isinstance(value, float) or not low <= value <= high:
        raise StateDictError(f"{where}[{key!r}] must be an int in [{low}, {high}] ({why}), got "
                             f"{key}={short_repr(value)}. Fix: load the dict that library's scaler wrote "
                             "with the settings this scaler was built with.")
    return value


def _scale(state: Mapping[str, Any], key: str, where: str) -> float:
    value = _number(state, key, where)
    if not (isinstance(value, float) or abs(value) < 2**128) or not (
            math.isfinite(value) and SCALE_FLOOR <= value <= SCALE_CEILING):  # 10**400: no float
        raise StateDictError(f"{where}[{key!r}] must be a finite scale > 0 that float32 holds (2**-126 to "
                             f"~3.4e38), got {key}={short_repr(value)}. "
                             "Fix: resume from an earlier checkpoint.")
    return float(value)


def _same(value: Any, wanted: Any) -> bool:
    """``value == wanted`` as one bool; False where no single bool comes of it (an array of several)."""
    try:
        return bool(value == wanted)
    except (ValueError, RuntimeError, TypeError):
        return False


def _megatron(state: Mapping[str, Any], config: LossScaleConfig, where: str) -> tuple[float, int, int]:
    hysteresis = config.backoff_interval
    growth = _int(state, "growth_tracker", where, 0, config.growth_interval - 1,
                  f"below the scaler's growth_interval={config.growth_interval}")
    tracker = _int(state, "hysteresis_tracker", where, -2**31, hysteresis,
                   f"at most the scaler's backoff_interval={hysteresis} (Megatron's hysteresis)")
    return _scale(state, "scale", where), growth, min(hysteresis - tracker, hysteresis - 1)


def _deepspeed(state: Mapping[str, Any], config: LossScaleConfig, where: str) -> tuple[float, int, int]:
    if not (_same(state.get("dynamic_loss_scale", True), True) and _same(state.get("dynamic", True), True)):
        raise StateDictError(f"{where} is a static scale (dynamic_loss_scale False). Fix: build "
                             "LossScaler(init_scale=cur_scale, dynamic=False) instead of loading it.")
    for key, read in _DEEPSPEED_SETTINGS.items():
        if key in state and not _same(state[key], read(config)):
            raise StateDictError(
                f"{where}[{key!r}] is {short_repr(state[key])}, but this scaler's config has "
                f"{short_repr(read(config))} there. Fix: build the scaler with that run's settings "
                "(docs/rule.md, 'Coming from DeepSpeed'), then load it; the scaler is unchanged.")
    shift = config.backoff_interval
    if "cur_hysteresis" in state:
        hysteresis = _int(state, "cur_hysteresis", where, 1, shift,
                          f"at most the scaler's backoff_interval={shift} (DeepSpeed's delayed_shift)")
    elif shift == 1:
        hysteresis = 1  # FP16_Optimizer's state (no hysteresis) with a rule of none
    else:
        raise StateDictError(f"{where} has no 'cur_hysteresis' (FP16_Optimizer's state, whose update has "
                             f"no hysteresis), but the scaler's backoff_interval is {shift}. Fix: build "
                             "the scaler with backoff_interval=1 to resume it.")
    cur_iter = _int(state, "cur_iter", where, 0, 2**62, "updates so far")
    last = _int(state, "last_overflow_iter", where, -1, cur_iter - 1, "an update before cur_iter, or -1")
    finite = cur_iter - last - 1  # finite steps since the last overflow (or the start)
    growth = 0 if finite == 0 else (finite - 1) % config.growth_interval + 1
    return _scale(state, "cur_scale", where), growth, shift - hysteresis
