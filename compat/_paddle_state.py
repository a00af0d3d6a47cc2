"""paddle.amp.GradScaler's argument checks and state-dict format, and the torch <-> paddle converters.

The key mapping is :data:`TORCH_NAMES` (and the engine's, ``_PADDLE_NAMES``); polyamp's extra keys
are written only where they differ from the other library's fixed behaviour, so default checkpoints
are exactly paddle's and torch's.
"""

from __future__ import annotations

import numbers
import re
from typing import Any

import numpy as np

from polyamp import checkpoint
from polyamp._errors import ConfigError, StateDictError
from polyamp.config import LossScaleConfig, check_scale, short_repr
from polyamp.engine import LossScaler

from ._torch_state import TORCH_KEYS, torch_format

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
TORCH_NAMES = {  # paddle key -> the torch key it was converted from, for messages
    "incr_ratio": "growth_factor", "decr_ratio": "backoff_factor", "incr_every_n_steps": "growth_interval",
    "decr_every_n_nan_or_inf": "backoff_interval", "incr_count": "_growth_tracker",
    "decr_count": "_backoff_tracker",
}
_TORCH_DEFAULTS = {"backoff_interval": 1, "_backoff_tracker": 0}  # polyamp's keys, absent from torch's


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
    if not (value > 1.0 if above_one else value < 1.0):
        raise PaddleConfigError(f"The {name} must be {'>' if above_one else '<'} 1.0. Got {name}={value!r}.")


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
    values = (np.array([host.scale], dtype=np.float32), config.growth_factor, config.backoff_factor,
              config.growth_interval, config.backoff_interval, host.growth_tracker, host.backoff_tracker,
              config.dynamic)
    state: dict[str, Any] = dict(zip(PADDLE_KEYS, values))
    state.update({k: getattr(config, k) for k in _EXTRAS if getattr(config, k) is not None})
    if engine.guard is not None:  # polyamp's: the StepGuard's histories and streak
        state["guard"] = engine.guard_history.to_dict()
    return state


def scale_of(value: Any) -> float:
    """The scale stored under ``"scale"`` (a 1-element array or a number), checked and rounded to
    float32; StateDictError naming the key and the value."""
    number = value
    if hasattr(value, "shape") or hasattr(value, "__array__"):  # paddle's [1] array, a tensor
        try:
            flat = np.asarray(value).reshape(-1)
        except (TypeError, ValueError, RuntimeError):
            flat = np.empty(0)
        if flat.size != 1 or flat.dtype.kind not in "iuf":
            raise StateDictError(
                f"state_dict['scale'] must hold one number, got {short_repr(value)} "
                f"({flat.size} elements). Fix: store it as paddle does, a 1-element float32 array "
                "such as np.array([65536.0], np.float32), or as a float (torch's format)."
            )
        number = flat[0].item()
    try:
        scale = check_scale("scale", plain(number), StateDictError)
    except StateDictError as exc:
        raise StateDictError(f"state_dict['scale'] is invalid: {exc}") from None
    return float(np.float32(scale))


def _count(state: dict[str, Any], key: str, interval: int, interval_key: str, names: dict[str, str]) -> int:
    """A saved counter: an int in [0, its interval) and below 2**31 (the trackers are int32)."""
    value, name = plain(state[key]), names.get(key, key)
    limit = min(interval, checkpoint.TRACKER_LIMIT)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not 0 <= value < limit:
        bound = f"{names.get(interval_key, interval_key)}={interval}" if limit == interval else "2**31"
        raise StateDictError(
            f"state_dict[{name!r}] must be an int >= 0 and below {bound}, got {name}={short_repr(value)}; "
            "a scaler never saves a count that has reached its interval. Fix: set it to 0 to "
            "restart the count."
        )
    return int(value)


def parse_paddle_state(
    state: dict[str, Any], base: LossScaleConfig, names: dict[str, str] | None = None
) -> tuple[LossScaleConfig, float, int, int]:
    """Validate a paddle-format state dict whole: ``(config, scale, incr_count, decr_count)``; ``base``
    supplies the fields paddle does not save, ``names`` the user's keys for messages."""
    names = names or {}
    missing = [k for k in PADDLE_KEYS if k not in state]
    if missing:
        raise PaddleStateDictError(
            f"GradScaler state_dict lacks key(s) {missing}; expected paddle's keys {list(PADDLE_KEYS)} "
            "(or torch's, which are converted)"
        )
    scale = scale_of(state["scale"])
    dynamic = plain(state["use_dynamic_loss_scaling"])
    if not isinstance(dynamic, bool):
        raise StateDictError(
            f"state_dict['use_dynamic_loss_scaling'] must be True or False, got {short_repr(dynamic)} "
            f"({type(dynamic).__name__}). Fix: store a bool, as paddle's state_dict() does."
        )
    engine_names = {field: names.get(key, key) for field, key in _PADDLE_NAMES.items()}
    try:
        config = build_config(
            base.replace, engine_names, growth_factor=state["incr_ratio"],
            backoff_factor=state["decr_ratio"], growth_interval=state["incr_every_n_steps"],
            backoff_interval=state["decr_every_n_nan_or_inf"], dynamic=dynamic,
            **{k: state.get(k) for k in _EXTRAS},
        )
    except PaddleConfigError as exc:
        raise StateDictError(f"GradScaler state_dict has an invalid value: {exc}") from None
    incr = _count(state, "incr_count", config.growth_interval, "incr_every_n_steps", names)
    decr = _count(state, "decr_count", config.backoff_interval, "decr_every_n_nan_or_inf", names)
    return config, scale, incr, decr


def load_paddle_state(engine: LossScaler, state: dict[str, Any]) -> float:
    """Load a paddle-format (or torch-format) state dict into ``engine``; validated whole first.
    Returns the scale."""
    names = None
    if "growth_factor" in state and "incr_ratio" not in state:  # torch's keys
        state, names = from_torch_state_dict(state), TORCH_NAMES
    config, scale, incr, decr = parse_paddle_state(state, engine.config, names)
    full = engine.state_now()
    full.update(config=config.to_dict(), scale=scale, growth_tracker=incr, backoff_tracker=decr)
    full.pop("guard", None)  # a state dict without histories (paddle's, older ones): empty ones
    if "guard" in state:
        full["guard"] = state["guard"]
    engine.load_state_dict(full)
    return scale


# -- converters ---------------------------------------------------------------------------
def from_torch_state_dict(state: dict[str, Any]) -> dict[str, Any]:
    """A torch-format GradScaler state dict (torch's or polyamp's, extra keys kept) in paddle's format."""
    if len(state) == 0:
        return {}
    missing = [k for k in TORCH_KEYS if k not in state]
    if missing:
        raise PaddleStateDictError(
            f"torch GradScaler state_dict lacks key(s) {missing}; expected {list(TORCH_KEYS)}"
        )
    paddle_state: dict[str, Any] = {"scale": np.array([scale_of(state["scale"])], dtype=np.float32)}
    paddle_state.update({key: plain(state.get(name, _TORCH_DEFAULTS.get(name)))
                         for key, name in TORCH_NAMES.items()})
    paddle_state["use_dynamic_loss_scaling"] = True
    paddle_state.update({k: state[k] for k in _EXTRAS if state.get(k) is not None})
    return paddle_state


def to_torch_state_dict(state: dict[str, Any]) -> dict[str, Any]:
    """A paddle-format GradScaler state dict in torch's format (polyamp's extra keys where needed);
    torch has no fixed-scale mode, so ``use_dynamic_loss_scaling=False`` raises StateDictError."""
    if len(state) == 0:
        return {}
    config, scale, incr, decr = parse_paddle_state(state, LossScaleConfig(product_dtype="float32"))
    if not config.dynamic:
        raise StateDictError(
            "use_dynamic_loss_scaling=False has no torch equivalent (torch.amp.GradScaler always "
            "scales dynamically). Fix: load it into polyamp.compat.paddle.GradScaler, or set "
            "state_dict['use_dynamic_loss_scaling'] = True to convert it as a dynamic scaler."
        )
    torch_state = torch_format(config, scale, incr, decr)
    torch_state.update(growth_factor=float(config.growth_factor), backoff_factor=float(config.backoff_factor))
    return torch_state
