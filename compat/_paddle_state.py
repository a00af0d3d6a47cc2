"""paddle.amp.GradScaler's argument checks and state-dict format, and the torch <-> paddle converters.

Key mapping (paddle -> torch; the engine's names in brackets)::

    scale (1-element float32 array)  <->  scale (float)             [scale]
    incr_ratio                       <->  growth_factor             [growth_factor]
    decr_ratio                       <->  backoff_factor            [backoff_factor]
    incr_every_n_steps               <->  growth_interval           [growth_interval]
    incr_count                       <->  _growth_tracker           [growth_tracker]
    decr_every_n_nan_or_inf          <->  backoff_interval *        [backoff_interval]
    decr_count                       <->  _backoff_tracker *        [backoff_tracker]
    use_dynamic_loss_scaling         <->  (torch: always True)      [dynamic]
    min_scale *, max_scale *         <->  min_scale *, max_scale *  [min_scale, max_scale]

``*``: polyamp's extra keys, written only when they differ from the other library's fixed
behaviour, so default checkpoints are exactly paddle's and torch's.
"""

from __future__ import annotations

import math
import numbers
import re
from typing import Any

import numpy as np

from polyamp._errors import ConfigError, StateDictError
from polyamp.config import LossScaleConfig
from polyamp.engine import LossScaler

from ._torch_state import TORCH_KEYS

PADDLE_KEYS = (
    "scale", "incr_ratio", "decr_ratio", "incr_every_n_steps", "decr_every_n_nan_or_inf",
    "incr_count", "decr_count", "use_dynamic_loss_scaling",
)
_PADDLE_NAMES = {
    "init_scale": "init_loss_scaling", "growth_factor": "incr_ratio", "backoff_factor": "decr_ratio",
    "growth_interval": "incr_every_n_steps", "backoff_interval": "decr_every_n_nan_or_inf",
    "dynamic": "use_dynamic_loss_scaling",
}
_EXTRAS = ("min_scale", "max_scale")


class PaddleConfigError(ConfigError, AssertionError):
    """A bad argument: an AssertionError as paddle's asserts raise, and a polyamp ConfigError."""


class PaddleStateDictError(StateDictError, KeyError):
    """A state dict lacking keys: a KeyError as paddle raises, and a polyamp StateDictError."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


def plain(value: Any) -> Any:
    """NumPy scalars as Python numbers (paddle state dicts carry np.float32), others unchanged."""
    return value.item() if isinstance(value, np.generic) else value


def check_ratio(name: str, value: Any, above_one: bool) -> None:
    """paddle's assert on incr_ratio (> 1) or decr_ratio (< 1); non-numbers are left to the config."""
    value = plain(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return
    if above_one and not value > 1.0:
        raise PaddleConfigError(f"The {name} must be > 1.0. Got {name}={value!r}.")
    if not above_one and not value < 1.0:
        raise PaddleConfigError(f"The {name} must be < 1.0. Got {name}={value!r}.")


def make_config(
    init_loss_scaling: float, incr_ratio: float, decr_ratio: float, incr_every_n_steps: int,
    decr_every_n_nan_or_inf: int, use_dynamic_loss_scaling: bool, **extras: Any,
) -> LossScaleConfig:
    """The engine config for paddle's arguments; errors name paddle's parameters."""
    check_ratio("incr_ratio", incr_ratio, above_one=True)
    check_ratio("decr_ratio", decr_ratio, above_one=False)
    return build_config(
        LossScaleConfig, init_scale=init_loss_scaling, growth_factor=incr_ratio,
        backoff_factor=decr_ratio, growth_interval=incr_every_n_steps,
        backoff_interval=decr_every_n_nan_or_inf, dynamic=use_dynamic_loss_scaling,
        product_dtype="float32", **extras,
    )


def build_config(make: Any, rename: dict[str, str] | None = None, **fields: Any) -> LossScaleConfig:
    """``make(**fields)`` with NumPy scalars made plain; a ConfigError is re-worded in paddle's names."""
    names = {**_PADDLE_NAMES, **(rename or {})}
    try:
        return make(**{k: plain(v) for k, v in fields.items()})
    except ConfigError as exc:
        message = re.sub(r"\b(\w+)\b", lambda m: names.get(m.group(1), m.group(1)), str(exc))
        raise PaddleConfigError(message) from None


# -- paddle's format ----------------------------------------------------------------------
def to_paddle_state(engine: LossScaler) -> dict[str, Any]:
    """The engine's state in paddle's GradScaler format (a device sync)."""
    config, host = engine.config, engine.host_state()
    state: dict[str, Any] = {
        "scale": np.array([host.scale], dtype=np.float32),
        "incr_ratio": config.growth_factor,
        "decr_ratio": config.backoff_factor,
        "incr_every_n_steps": config.growth_interval,
        "decr_every_n_nan_or_inf": config.backoff_interval,
        "incr_count": host.growth_tracker,
        "decr_count": host.backoff_tracker,
        "use_dynamic_loss_scaling": config.dynamic,
    }
    state.update({k: getattr(config, k) for k in _EXTRAS if getattr(config, k) is not None})
    return state


def scale_of(value: Any) -> float:
    """The scale stored under ``"scale"``: a 1-element array/tensor (paddle) or a number (torch)."""
    flat = np.asarray(value, dtype=np.float64).reshape(-1)
    if flat.size != 1 or not (math.isfinite(flat[0]) and flat[0] > 0):
        raise StateDictError(
            f"state_dict['scale'] must be one finite number > 0 (paddle saves a 1-element "
            f"float32 array), got {value!r}"
        )
    return float(np.float32(flat[0]))


def _count(state: dict[str, Any], key: str) -> int:
    value = plain(state[key])
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise StateDictError(f"state_dict[{key!r}] must be an int >= 0, got {value!r}")
    return int(value)


def load_paddle_state(engine: LossScaler, state: dict[str, Any]) -> float:
    """Load a paddle-format state dict into ``engine``; validated whole first. Returns the scale."""
    missing = [k for k in PADDLE_KEYS if k not in state]
    if missing:
        raise PaddleStateDictError(
            f"GradScaler state_dict lacks key(s) {missing}; expected paddle's keys {list(PADDLE_KEYS)} "
            "(or torch's, which are converted)"
        )
    scale = scale_of(state["scale"])
    try:
        config = build_config(
            engine.config.replace, growth_factor=state["incr_ratio"], backoff_factor=state["decr_ratio"],
            growth_interval=state["incr_every_n_steps"],
            backoff_interval=state["decr_every_n_nan_or_inf"],
            dynamic=bool(state["use_dynamic_loss_scaling"]), **{k: state.get(k) for k in _EXTRAS},
        )
    except PaddleConfigError as exc:
        raise StateDictError(f"GradScaler state_dict has an invalid value: {exc}") from None
    full = engine.state_dict()
    full.update(config=config.to_dict(), scale=scale, growth_tracker=_count(state, "incr_count"),
                backoff_tracker=_count(state, "decr_count"))
    engine.load_state_dict(full)
    return scale


# -- converters ---------------------------------------------------------------------------
def is_torch_format(state: dict[str, Any]) -> bool:
    """Whether ``state`` has torch's GradScaler keys rather than paddle's."""
    return "growth_factor" in state and "incr_ratio" not in state


def from_torch_state_dict(state: dict[str, Any]) -> dict[str, Any]:
    """A torch-format GradScaler state dict in paddle's format (``{}`` stays ``{}``).

    Accepts ``torch.amp.GradScaler.state_dict()`` and ``polyamp.compat.torch.GradScaler``'s,
    whose extra keys (backoff_interval, _backoff_tracker, min_scale, max_scale) carry over.
    """
    if len(state) == 0:
        return {}
    missing = [k for k in TORCH_KEYS if k not in state]
    if missing:
        raise PaddleStateDictError(
            f"torch GradScaler state_dict lacks key(s) {missing}; expected {list(TORCH_KEYS)}"
        )
    paddle_state: dict[str, Any] = {
        "scale": np.array([scale_of(state["scale"])], dtype=np.float32),
        "incr_ratio": plain(state["growth_factor"]),
        "decr_ratio": plain(state["backoff_factor"]),
        "incr_every_n_steps": plain(state["growth_interval"]),
        "decr_every_n_nan_or_inf": plain(state.get("backoff_interval", 1)),
        "incr_count": plain(state["_growth_tracker"]),
        "decr_count": plain(state.get("_backoff_tracker", 0)),
        "use_dynamic_loss_scaling": True,
    }
    paddle_state.update({k: state[k] for k in _EXTRAS if state.get(k) is not None})
    return paddle_state


def to_torch_state_dict(state: dict[str, Any]) -> dict[str, Any]:
    """A paddle-format GradScaler state dict in torch's format, for torch's or polyamp's GradScaler.

    torch has no fixed-scale mode: ``use_dynamic_loss_scaling=False`` raises StateDictError.
    decr_every_n_nan_or_inf != 1 is kept in polyamp's extra keys, which real torch ignores.
    """
    if len(state) == 0:
        return {}
    missing = [k for k in PADDLE_KEYS if k not in state]
    if missing:
        raise PaddleStateDictError(f"paddle GradScaler state_dict lacks key(s) {missing}")
    if not state["use_dynamic_loss_scaling"]:
        raise StateDictError(
            "use_dynamic_loss_scaling=False has no torch equivalent (torch.amp.GradScaler always "
            "scales dynamically). Fix: load it into polyamp.compat.paddle.GradScaler, or set "
            "state_dict['use_dynamic_loss_scaling'] = True to convert it as a dynamic scaler."
        )
    torch_state: dict[str, Any] = {
        "scale": scale_of(state["scale"]),
        "growth_factor": float(plain(state["incr_ratio"])),
        "backoff_factor": float(plain(state["decr_ratio"])),
        "growth_interval": int(plain(state["incr_every_n_steps"])),
        "_growth_tracker": int(plain(state["incr_count"])),
    }
    interval, decr_count = int(plain(state["decr_every_n_nan_or_inf"])), int(plain(state["decr_count"]))
    if interval != 1 or decr_count:
        torch_state.update(backoff_interval=interval, _backoff_tracker=decr_count)
    torch_state.update({k: state[k] for k in _EXTRAS if state.get(k) is not None})
    return torch_state
