"""torch.amp.GradScaler's state-dict format and the input checks torch applies, for the facades.

Key mapping (torch -> polyamp engine): ``scale`` -> scale, ``growth_factor``,
``backoff_factor``, ``growth_interval`` -> config fields, ``_growth_tracker`` ->
growth_tracker. polyamp adds ``backoff_interval``, ``_backoff_tracker``, ``min_scale`` and
``max_scale`` only when they differ from torch's fixed behaviour, so a default scaler's
state dict is exactly torch's and each loads into the other.
"""

from __future__ import annotations

from typing import Any

from polyamp._errors import StateDictError
from polyamp.engine import LossScaler

TORCH_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")
_NEW_SCALE = (
    "new_scale should be a float or a 1-element torch.cuda.FloatTensor or "
    "torch.FloatTensor with requires_grad=False."
)


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
    """Load a torch-format state dict into ``engine``; nothing changes if it is invalid."""
    missing = [k for k in TORCH_KEYS if k not in state]
    if missing:
        raise StateDictError(
            f"GradScaler state_dict lacks key(s) {missing}; expected torch's keys {list(TORCH_KEYS)}"
        )
    full = engine.state_dict()
    full["config"].update(
        growth_factor=float(state["growth_factor"]),
        backoff_factor=float(state["backoff_factor"]),
        growth_interval=int(state["growth_interval"]),
        backoff_interval=int(state.get("backoff_interval", 1)),
        min_scale=state.get("min_scale"),
        max_scale=state.get("max_scale"),
    )
    full["scale"] = float(state["scale"])
    full["growth_tracker"] = int(state["_growth_tracker"])
    full["backoff_tracker"] = int(state.get("_backoff_tracker", 0))
    engine.load_state_dict(full)


def is_array(value: Any) -> bool:
    """An array/tensor leaf (not a list, tuple or other container)."""
    return hasattr(value, "dtype") and hasattr(value, "shape") and not isinstance(value, (list, tuple))


def is_fp16(array: Any) -> bool:
    """Whether ``array`` holds IEEE float16 (torch.float16 or numpy/cupy float16)."""
    return str(array.dtype).rsplit(".", 1)[-1] == "float16"


def check_new_scale(new_scale: Any, device: str) -> None:
    """torch's checks on a tensor passed to update(new_scale): AssertionError when they fail."""
    dev = getattr(new_scale, "device", None)
    dev_type = getattr(dev, "type", None)
    if dev_type is not None and dev_type != device:
        raise AssertionError(_NEW_SCALE)
    if int(getattr(new_scale, "size", 1) if not callable(getattr(new_scale, "numel", None))
           else new_scale.numel()) != 1:
        raise AssertionError(_NEW_SCALE)
    if getattr(new_scale, "requires_grad", False) is True:
        raise AssertionError(_NEW_SCALE)
