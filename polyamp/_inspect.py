"""``polyamp inspect PATH``: what a checkpoint holds; nothing in it is ever executed.

Reads polyamp's own format (``LossScaler.save``, ``.gz`` too) and the torch- and paddle-facade
state dicts saved as JSON (``json.dump(scaler.state_dict(), f)``; paddle's 1-element ``scale``
as a number or a one-number list), and ``torch.save`` files through torch's restricted unpickler
(``torch.load(weights_only=True)``): every scaler state inside, with its path in the checkpoint
(:mod:`polyamp.compat._torch_checkpoints`). Anything else is a :class:`polyamp.StateDictError`
naming the file.
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

__all__ = ["as_json", "describe", "describe_all", "format_text"]

_TORCH = "torch GradScaler state_dict (JSON)"
_PADDLE = "paddle GradScaler state_dict (JSON)"


def describe_all(path: str) -> list[dict[str, Any]]:
    """Every scaler state in the file at ``path``: one for a JSON checkpoint, each one found (with
    ``"where"``, its path in the checkpoint) in a ``torch.save`` file. StateDictError naming the
    file when there is none or the file cannot be read."""
    name = repr(os.fspath(path))
    head = _head(path, name)
    from polyamp.compat import _torch_checkpoints as torch_files  # imports torch only to read one

    if not torch_files.is_torch_file(head):
        return [describe(path)]
    found = []
    for where, state in torch_files.scaler_states(torch_files.load(path), _is_state):
        try:
            kind, config, host, steps, skipped = _parse(torch_files.plain(state))
        except StateDictError as exc:
            raise StateDictError(f"{name}: {where}: {exc}") from None
        found.append(_info(path, kind.replace("(JSON)", "(torch.save)"), config, host, steps, skipped)
                     | {"where": where})
    if not found:
        raise StateDictError(
            f"{name} is a torch.save file with no scaler state in it (no dict with torch's GradScaler "
            "keys, paddle's, or polyamp's 'format'). Fix: pass the file the scaler was saved in (a "
            "training checkpoint's scaler entry, Lightning's .ckpt, accelerate's scaler.pt)."
        )
    return found


def _head(path: str, name: str) -> bytes:
    if os.path.isdir(path):
        raise StateDictError(f"{name} is a directory. Fix: pass the checkpoint file inside it.")
    try:
        with open(path, "rb") as f:
            return f.read(4)
    except OSError as exc:
        raise StateDictError(f"cannot read {name}: {exc.strerror or exc}") from None


def _is_state(candidate: dict[Any, Any]) -> bool:
    """Whether a dict found in a torch.save file is a scaler state (polyamp's, torch's or paddle's)."""
    from polyamp.compat._paddle_state import PADDLE_KEYS
    from polyamp.compat._torch_state import TORCH_KEYS

    return candidate.get("format") == checkpoint.FORMAT or all(k in candidate for k in TORCH_KEYS) or all(
        k in candidate for k in PADDLE_KEYS)


def _info(path: str, kind: str, config: LossScaleConfig, host: HostState, steps: int | None,
          skipped: int | None) -> dict[str, Any]:
    return {
        "path": os.fspath(path), "format": kind, "scale": host.scale,
        "growth_tracker": host.growth_tracker, "backoff_tracker": host.backoff_tracker,
        "steps": steps, "skipped_steps": skipped, "config": config.to_dict(),
    }


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
    return _info(path, kind, config, host, steps, skipped)


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
        "(a torch.save file is read with torch.load(weights_only=True))."
    )


def format_text(info: dict[str, Any]) -> str:
    """The description as lines a person reads."""
    counters = ("not saved in this format" if info["steps"] is None
                else f"{info['steps']} steps, {info['skipped_steps']} skipped")
    config = ", ".join(f"{k}={v}" for k, v in info["config"].items())
    where = [f"in:       {info['where']}"] if "where" in info else []
    return "\n".join([
        f"file:     {info['path']}",
        *where,
        f"format:   {info['format']}",
        f"scale:    {info['scale']:g}",
        f"trackers: growth {info['growth_tracker']}, backoff {info['backoff_tracker']}",
        f"counters: {counters}",
        f"config:   {config}",
    ])


def as_json(info: dict[str, Any] | list[dict[str, Any]]) -> str:
    """The description as JSON."""
    return json.dumps(info, indent=2, sort_keys=True)
