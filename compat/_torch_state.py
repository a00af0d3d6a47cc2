"""torch.amp.GradScaler's state-dict format and the input checks torch applies, for the facade.

Key mapping (torch -> polyamp engine): ``scale`` -> scale, ``growth_factor``,
``backoff_factor``, ``growth_interval`` -> config fields, ``_growth_tracker`` ->
growth_tracker. polyamp adds ``backoff_interval``, ``_backoff_tracker``, ``min_scale`` and
``max_scale`` only when they differ from torch's fixed behaviour, so a default scaler's
state dict is exactly torch's and each loads into the other.
"""

from __future__ import annotations

import numbers
from typing import Any

from polyamp import checkpoint
from polyamp._errors import ConfigError, StateDictError
from polyamp.config import LossScaleConfig
from polyamp.engine import LossScaler

TORCH_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")
NEW_SCALE = (
    "new_scale should be a float or a 1-element torch.cuda.FloatTensor or "
    "torch.FloatTensor with requires_grad=False."
)


class StateDictKeyError(StateDictError, KeyError):
    """A torch-format state dict lacks a key; a KeyError as torch raises, and a StateDictError."""

    def __str__(self) -> str:  # KeyError would quote the whole message
        return str(self.args[0])


def to_torch_state(engine: LossScaler) -> dict[str, Any]:
    """The engine's state in torch's GradScaler format (a device sync)."""
    config, host = engine.config, engine.host_state()
    state: dict[str, Any] = {
        "scale": host.scale,
        "growth_factor": config.growth_factor,
        "backoff_factor": config.backoff_factor,
        "growth_interval": config.growth_interval,
        "_growth_tracker": host.growth_tracker,
    }
    if config.backoff_interval != 1 or host.backoff_tracker:
        state["backoff_interval"] = config.backoff_interval
        state["_backoff_tracker"] = host.backoff_tracker
    if config.min_scale is not None:
        state["min_scale"] = config.min_scale
    if config.max_scale is not None:
        state["max_scale"] = config.max_scale
    return state


def load_torch_state(engine: LossScaler, state: dict[str, Any]) -> None:
    """Load a torch-format (or polyamp engine) state dict into ``engine``; all or nothing.

    Validated completely before anything changes: a bad dict leaves the scaler as it was.
    """
    if state.get("format") == checkpoint.FORMAT:
        engine.load_state_dict(state)
        return
    missing = [k for k in TORCH_KEYS if k not in state]
    if missing:
        raise StateDictKeyError(
            f"GradScaler state_dict lacks key(s) {missing}; expected torch's keys "
            f"{list(TORCH_KEYS)} as written by GradScaler.state_dict()"
        )
    full = engine.state_dict()
    full["config"].update(
        growth_factor=_convert(state, "growth_factor", float),
        backoff_factor=_convert(state, "backoff_factor", float),
        growth_interval=_convert(state, "growth_interval", int),
        backoff_interval=_convert(state, "backoff_interval", int, 1),
        min_scale=state.get("min_scale"),
        max_scale=state.get("max_scale"),
    )
    full["scale"] = _convert(state, "scale", float)
    full["growth_tracker"] = _convert(state, "_growth_tracker", int)
    full["backoff_tracker"] = _convert(state, "_backoff_tracker", int, 0)
    engine.load_state_dict(full)


def _convert(state: dict[str, Any], key: str, kind: type, default: Any = None) -> Any:
    """``kind(state[key])``, or a StateDictError naming the key and the value."""
    value = state.get(key, default)
    try:
        if isinstance(value, bool) or (kind is int and value != int(value)):
            raise ValueError
        return kind(value)
    except (TypeError, ValueError):
        raise StateDictError(
            f"GradScaler state_dict[{key!r}] must be a {kind.__name__}, got {value!r}"
        ) from None


def is_array(value: Any) -> bool:
    """An array/tensor leaf (not a list, tuple or other container)."""
    return (
        hasattr(value, "dtype") and hasattr(value, "shape") and not isinstance(value, (list, tuple))
    )


def _numel(array: Any) -> int:
    numel = getattr(array, "numel", None)
    return int(numel() if callable(numel) else getattr(array, "size", 1))


def check_new_scale(new_scale: Any, device: str) -> None:
    """torch's checks on a tensor passed to update(new_scale): AssertionError when they fail."""
    number = isinstance(new_scale, (int, float)) and not isinstance(new_scale, bool)
    if not (number or is_array(new_scale)):
        raise TypeError(
            "new_scale must be a float or a 1-element tensor/array, got "
            f"new_scale={new_scale!r} ({type(new_scale).__name__}); pass e.g. update(1024.0)"
        )
    if number:
        return
    dev_type = getattr(getattr(new_scale, "device", None), "type", None)
    if dev_type is not None and dev_type != device:
        raise AssertionError(NEW_SCALE)
    if _numel(new_scale) != 1:
        raise AssertionError(NEW_SCALE)
    if getattr(new_scale, "requires_grad", False) is True:
        raise AssertionError(NEW_SCALE)


class TorchConfigError(ConfigError, AssertionError):
    """A bad constructor value; an AssertionError as torch raises, and a polyamp ConfigError."""


def torch_config(init_scale: Any, growth_factor: Any, backoff_factor: Any,
                  growth_interval: Any, backoff_interval: Any, min_scale: Any,
                  max_scale: Any) -> LossScaleConfig:
    """torch's two asserts first (same messages), then polyamp's full validation."""
    init_scale, growth_factor, backoff_factor = map(_as_float, (init_scale, growth_factor,
                                                                 backoff_factor))
    if growth_factor <= 1.0:
        raise TorchConfigError(
            f"The growth factor must be > 1.0. Got growth_factor={growth_factor!r}."
        )
    if backoff_factor >= 1.0:
        raise TorchConfigError(
            f"The backoff factor must be < 1.0. Got backoff_factor={backoff_factor!r}."
        )
    try:
        return LossScaleConfig(
            init_scale=init_scale, growth_factor=growth_factor,
            backoff_factor=backoff_factor, growth_interval=growth_interval,
            backoff_interval=backoff_interval, min_scale=min_scale, max_scale=max_scale,
        )
    except ConfigError as exc:
        raise TorchConfigError(f"{exc}. Fix: pass a valid value to GradScaler(...)") from None


def _as_float(value: Any) -> Any:
    """Real numbers (NumPy scalars too) as Python floats; anything else left for validation."""
    real = isinstance(value, numbers.Real) and not isinstance(value, bool)
    return float(value) if real else value
