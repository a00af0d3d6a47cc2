"""torch.amp.GradScaler's state-dict format and the input checks torch applies, for the facade.

polyamp's extra keys are written only where they differ from torch's, so a default scaler's state
dict is exactly torch's and each loads into the other.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from typing import Any

from polyamp import checkpoint
from polyamp._errors import ConfigError, StateDictError
from polyamp._foreign_state import layout
from polyamp.config import LossScaleConfig, check_scale, fits_float, short_repr
from polyamp.engine import LossScaler
from polyamp.guard import GuardHistory
from polyamp.policy import fit_to_config

TORCH_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")
#: polyamp's keys for a rule beyond torch's, and their torch values (written only where they differ)
RULE_KEYS = {"rule": "torch", "consecutive_hysteresis": False, "raise_error_at_min_scale": False,
             "product_dtype": None}


class StateDictKeyError(StateDictError, KeyError):
    """A torch-format state dict lacks a key; a KeyError as torch raises, and a StateDictError."""

    def __str__(self) -> str:  # KeyError would quote the whole message
        return str(self.args[0])


def to_torch_state(engine: LossScaler, histories: Mapping[int, GuardHistory], metered: bool = False
                   ) -> dict[str, Any]:
    """The engine's state in torch's format (a device sync), trackers fitted to the config so the dict
    loads; ``metered``: ``"steps"`` (the meter's phase) written too."""
    config = engine.config
    host = fit_to_config(engine.host_state(), config)
    state = torch_format(config, host.scale, host.growth_tracker, host.backoff_tracker)
    state.update({k: v for k, default in RULE_KEYS.items() if (v := getattr(config, k)) != default})
    if engine.guard is not None:  # polyamp's: each optimizer's StepGuard history, in step order
        groups = range(max(histories, default=-1) + 1)
        state["guard"] = [histories.get(g, GuardHistory()).to_dict() for g in groups]
    if metered:  # polyamp's: the steps taken, so a resumed meter samples where it would have
        state["steps"] = engine.steps
    return state


def torch_format(config: LossScaleConfig, scale: float, growth_tracker: int, backoff_tracker: int
                 ) -> dict[str, Any]:
    """torch's five keys, and polyamp's for a backoff interval or count and scale bounds where set."""
    values = (scale, config.growth_factor, config.backoff_factor, config.growth_interval, growth_tracker)
    state: dict[str, Any] = dict(zip(TORCH_KEYS, values))
    if config.backoff_interval != 1 or backoff_tracker:
        state.update(backoff_interval=config.backoff_interval, _backoff_tracker=backoff_tracker)
    state.update({k: v for k in ("min_scale", "max_scale") if (v := getattr(config, k)) is not None})
    return state


def load_torch_state(engine: LossScaler, state: Mapping[str, Any]) -> dict[int, GuardHistory] | None:
    """Load a torch-format (or polyamp engine) state dict into ``engine``, validated whole first; the
    guard's histories per optimizer to load (None: the engine's own format loaded them)."""
    if not isinstance(state, Mapping):
        raise StateDictError(
            f"GradScaler.load_state_dict: state_dict must be a dict as written by "
            f"GradScaler.state_dict(), got {short_repr(state)} ({type(state).__name__})"
        )
    if state.get("format") == checkpoint.FORMAT or layout(state) is not None:  # or Megatron/DeepSpeed
        engine.load_state_dict(dict(state))
        return None
    histories = _guard_histories(state)
    missing = [k for k in TORCH_KEYS if k not in state]
    if missing:
        raise StateDictKeyError(
            f"GradScaler state_dict lacks key(s) {missing}; expected torch's keys "
            f"{list(TORCH_KEYS)} as written by GradScaler.state_dict()"
        )
    try:
        full = _engine_state(engine, state)
    except StateDictError as exc:
        raise StateDictError(
            f"GradScaler.load_state_dict: {str(exc).rstrip('.')}. Fix: load a state dict written by "
            "GradScaler.state_dict(), or correct that value; the scaler is unchanged."
        ) from None
    engine.load_state_dict(full)
    if engine.guard is None:
        return {}
    return {g: h.fitted(engine.guard.window) for g, h in enumerate(histories)}  # none in torch's: empty


def _guard_histories(state: Mapping[str, Any]) -> list[GuardHistory]:
    """The StepGuard histories under ``"guard"`` (polyamp's key), validated; [] without it."""
    given = state.get("guard", [])
    if not isinstance(given, list):
        raise StateDictError(f"GradScaler state_dict['guard'] must be a list of StepGuard histories, got "
                             f"{short_repr(given)}. Fix: load a state dict written by "
                             "GradScaler.state_dict().")
    return [GuardHistory.from_dict(h, f"state_dict['guard'][{g}]") for g, h in enumerate(given)]


def _engine_state(engine: LossScaler, state: Mapping[str, Any]) -> dict[str, Any]:
    """The engine's state dict holding ``state``'s values, each checked under its torch key."""
    growth_interval = _integer(state, "growth_interval")  # its range is the config's to check
    backoff_interval = _integer(state, "backoff_interval", 1)
    bounds = {k: None if state.get(k) is None else check_scale(k, _number(state, k), StateDictError)
              for k in ("min_scale", "max_scale")}
    rule = {key: state[key] for key in RULE_KEYS if key in state}  # absent: the scaler's own
    try:
        config = engine.config.replace(
            growth_factor=_factor(state, "growth_factor"),
            backoff_factor=_factor(state, "backoff_factor"),
            growth_interval=growth_interval, backoff_interval=backoff_interval, **bounds, **rule,
        )
    except ConfigError as exc:
        raise StateDictError(str(exc)) from None
    full = engine.state_now()
    full.update(
        config=config.to_dict(),
        scale=check_scale("scale", _number(state, "scale"), StateDictError),
        growth_tracker=_tracker(state, "_growth_tracker", "growth_interval", growth_interval),
        backoff_tracker=_tracker(state, "_backoff_tracker", "backoff_interval", backoff_interval),
    )
    if "steps" in state:  # polyamp's (written with a meter): the steps taken, the meter's phase
        steps = _integer(state, "steps")
        if not 0 <= steps < checkpoint.COUNTER_LIMIT:
            raise StateDictError(f"steps must be an int in [0, 2**63), got steps={short_repr(steps)}")
        full.update(steps=steps, skipped_steps=min(full["skipped_steps"], steps))
    return full


def _number(state: Mapping[str, Any], key: str, default: Any = None) -> int | float:
    """``state[key]`` as a Python int or float (NumPy scalars and 1-element tensors by ``.item()``)."""
    value = state.get(key, default)
    if is_array(value) and hasattr(value, "item") and _numel(value) == 1:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise StateDictError(f"{key} must be a number, got {key}={short_repr(value)} "
                             f"({type(value).__name__})")
    return value


def _factor(state: Mapping[str, Any], key: str) -> float:
    """A finite factor as a float (its range is the config's to check)."""
    value = _number(state, key)
    number = float(value) if fits_float(value) else math.inf  # an int beyond float64: inf
    if not math.isfinite(number):
        raise StateDictError(f"{key} must be a finite number, got {key}={short_repr(value)}")
    return number


def _integer(state: Mapping[str, Any], key: str, default: Any = None) -> int:
    """An int, or a float holding an integer (as torch's int tensors take); else an error."""
    value = _number(state, key, default)
    if isinstance(value, float):
        if not value.is_integer():  # also inf and nan
            raise StateDictError(f"{key} must be an int, got {key}={short_repr(value)}")
        return int(value)
    return value


def _tracker(state: Mapping[str, Any], key: str, interval_key: str, interval: int) -> int:
    """A step counter: an int in [0, interval) and below 2**31 (it is int32 on the device)."""
    value = _integer(state, key, 0 if key == "_backoff_tracker" else None)
    limit = min(interval, checkpoint.TRACKER_LIMIT)
    if not 0 <= value < limit:
        raise StateDictError(
            f"{key} must be an int in [0, {limit}) (below {interval_key}={interval} and 2**31, "
            f"as the update keeps it), got {key}={short_repr(value)}"
        )
    return value


def refuse_empty(state_dict: Mapping[str, Any], which: str) -> None:
    """torch's and paddle's RuntimeError for an empty state dict (a disabled scaler's), worded as
    each library words it: ``which`` is "source" (torch) or "input" (paddle)."""
    if len(state_dict) == 0:
        raise RuntimeError(
            f"The {which} state dict is empty, possibly because it was saved "
            "from a disabled instance of GradScaler."
        )


def is_array(value: Any) -> bool:
    """An array/tensor leaf (not a list, tuple or other container)."""
    return hasattr(value, "dtype") and hasattr(value, "shape") and not isinstance(value, (list, tuple))


def _numel(array: Any) -> int:
    numel = getattr(array, "numel", None)
    return int(numel() if callable(numel) else getattr(array, "size", 1))


def check_new_scale(new_scale: Any, device: str) -> None:
    """torch's checks on a tensor passed to update(new_scale): AssertionError when they fail."""
    if isinstance(new_scale, (int, float)) and not isinstance(new_scale, bool):
        return
    if not is_array(new_scale):
        raise TypeError(
            "new_scale must be a float or a 1-element tensor/array, got "
            f"new_scale={new_scale!r} ({type(new_scale).__name__}); pass e.g. update(1024.0)"
        )
    dev_type = getattr(getattr(new_scale, "device", None), "type", None)
    if (dev_type not in (None, device) or _numel(new_scale) != 1
            or getattr(new_scale, "requires_grad", False) is True):
        raise AssertionError("new_scale should be a float or a 1-element torch.cuda.FloatTensor or "
                             "torch.FloatTensor with requires_grad=False.")  # torch's


class TorchConfigError(ConfigError, AssertionError):
    """A bad constructor value; an AssertionError as torch raises, and a polyamp ConfigError."""


def torch_config(init_scale: Any, growth_factor: Any, backoff_factor: Any,
                  growth_interval: Any, backoff_interval: Any, min_scale: Any,
                  max_scale: Any) -> LossScaleConfig:
    """torch's two asserts first (same messages), then polyamp's full validation (intervals: below 2**63)."""
    init_scale, growth_factor, backoff_factor = (  # real numbers (NumPy scalars too) as Python floats
        float(v) if isinstance(v, numbers.Real) and not isinstance(v, bool) else v
        for v in (init_scale, growth_factor, backoff_factor))
    if growth_factor <= 1.0:
        raise TorchConfigError(f"The growth factor must be > 1.0. Got growth_factor={growth_factor!r}.")
    if backoff_factor >= 1.0:
        raise TorchConfigError(f"The backoff factor must be < 1.0. Got backoff_factor={backoff_factor!r}.")
    try:
        return LossScaleConfig(
            init_scale=init_scale, growth_factor=growth_factor,
            backoff_factor=backoff_factor, growth_interval=growth_interval,
            backoff_interval=backoff_interval, min_scale=min_scale, max_scale=max_scale,
        )
    except ConfigError as exc:
        raise TorchConfigError(f"{exc} (in GradScaler(...))") from None
