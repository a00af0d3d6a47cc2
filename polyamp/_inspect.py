"""``polyamp inspect PATH``: what a checkpoint holds, read as JSON only (nothing in it is executed).

Reads polyamp's own format (``LossScaler.save``, ``.gz`` too) and the torch- and paddle-facade
state dicts saved as JSON (``json.dump(scaler.state_dict(), f)``; paddle's 1-element ``scale``
as a number or a one-number list). Anything else is a :class:`polyamp.StateDictError` naming the file.
"""

from __future__ import annotations

import json
import os
from typing import Any

from . import checkpoint
from ._errors import StateDictError
from .config import LossScaleConfig
from .engine import LossScaler
from .policy import HostState

__all__ = ["as_json", "describe", "format_text"]

_TORCH = "torch GradScaler state_dict (JSON)"
_PADDLE = "paddle GradScaler state_dict (JSON)"


def describe(path: str) -> dict[str, Any]:
    """Format, scale, trackers, step counters and config of the checkpoint at ``path``.

    Raises StateDictError (naming the file) for anything polyamp cannot load.
    """
    name = repr(os.fspath(path))
    if os.path.isdir(path):
        raise StateDictError(f"{name} is a directory. Fix: pass the checkpoint file inside it.")
    try:
        data = checkpoint.read(path)
    except OSError as exc:
        raise StateDictError(f"cannot read {name}: {exc.strerror or exc}") from None
    if not isinstance(data, dict):
        raise StateDictError(
            f"{name} holds JSON {type(data).__name__}, not an object: not a checkpoint. Fix: pass a file "
            "written by LossScaler.save() or a facade's state_dict() saved with json.dump."
        )
    try:
        kind, config, host, steps, skipped = _parse(data)
    except StateDictError as exc:
        raise StateDictError(f"{name}: {exc}") from None
    return {
        "path": os.fspath(path), "format": kind, "scale": host.scale,
        "growth_tracker": host.growth_tracker, "backoff_tracker": host.backoff_tracker,
        "steps": steps, "skipped_steps": skipped, "config": config.to_dict(),
    }


def _parse(data: dict[str, Any]) -> tuple[str, LossScaleConfig, HostState, int | None, int | None]:
    if "format" in data:
        config, host, steps, skipped = checkpoint.from_state_dict(data)
        return f"{checkpoint.FORMAT} version {data['version']}", config, host, steps, skipped
    from polyamp.compat._paddle_state import PADDLE_KEYS, parse_paddle_state  # imports no framework
    from polyamp.compat._torch_state import TORCH_KEYS, load_torch_state

    if all(k in data for k in TORCH_KEYS):
        engine = LossScaler()
        load_torch_state(engine, data)
        return _TORCH, engine.config, engine.host_state(), None, None
    if all(k in data for k in PADDLE_KEYS):
        scale = data["scale"]
        if isinstance(scale, list) and len(scale) == 1:  # paddle's 1-element array, as JSON
            data = dict(data, scale=scale[0])
        config, scale, incr, decr = parse_paddle_state(data, LossScaleConfig())
        return _PADDLE, config, HostState(scale, incr, decr), None, None
    raise StateDictError(
        f"not a checkpoint polyamp can load: no 'format' key (polyamp's own), nor torch's keys "
        f"{list(TORCH_KEYS)}, nor paddle's {list(PADDLE_KEYS)}; it has {sorted(data)[:8]}. Fix: pass a "
        "file written by LossScaler.save(), or a facade's state_dict() saved with json.dump "
        "(torch.save files are pickles, which polyamp never loads)."
    )


def format_text(info: dict[str, Any]) -> str:
    """The description as lines a person reads."""
    counters = ("not saved in this format" if info["steps"] is None
                else f"{info['steps']} steps, {info['skipped_steps']} skipped")
    config = ", ".join(f"{k}={v}" for k, v in info["config"].items())
    return "\n".join([
        f"file:     {info['path']}",
        f"format:   {info['format']}",
        f"scale:    {info['scale']:g}",
        f"trackers: growth {info['growth_tracker']}, backoff {info['backoff_tracker']}",
        f"counters: {counters}",
        f"config:   {config}",
    ])


def as_json(info: dict[str, Any]) -> str:
    """The description as JSON."""
    return json.dumps(info, indent=2, sort_keys=True)
