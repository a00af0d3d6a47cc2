"""``polyamp inspect PATH``: what a checkpoint holds (polyamp's format, the facades' state dicts as
JSON, ``torch.save`` files by ``torch.load(weights_only=True)``); nothing in it is ever executed.
"""

from __future__ import annotations

import json
import os
from typing import Any

from . import checkpoint
from ._errors import StateDictError
from .checkpoint import regular_file
from .config import LossScaleConfig
from .engine import LossScaler
from .policy import HostState

__all__ = ["as_json", "describe", "describe_all", "format_text"]

#: The walk through a torch.save file: at most this many levels of nesting and this many items
#: (the entries of every dict, list and tuple visited; a container reached twice is walked once).
MAX_DEPTH, MAX_ITEMS = 100, 10_000_000
#: The config fields a torch-format state can hold, under the same keys (torch's own holds the first three).
_TORCH_FIELDS = ("growth_factor", "backoff_factor", "growth_interval", "backoff_interval", "min_scale",
                 "max_scale")
#: The config fields a paddle-format state can hold, and their keys (none holds init_loss_scaling).
_PADDLE_FIELDS = {"growth_factor": "incr_ratio", "backoff_factor": "decr_ratio",
                  "growth_interval": "incr_every_n_steps", "backoff_interval": "decr_every_n_nan_or_inf",
                  "dynamic": "use_dynamic_loss_scaling", "min_scale": "min_scale", "max_scale": "max_scale"}
NOT_SAVED = "not saved in this format"


def describe_all(path: str) -> list[dict[str, Any]]:
    """Every scaler state in the file at ``path`` (in a ``torch.save`` file each with ``"where"``);
    StateDictError naming the file when there is none."""
    name = _check_path(path)
    try:
        with open(path, "rb") as f:  # a regular file: opening it cannot block
            head = f.read(4)
    except OSError as exc:  # e.g. no permission to read it
        raise StateDictError(f"cannot read {name}: {exc.strerror or exc}") from None
    from polyamp.compat import _torch_checkpoints as torch_files  # imports torch only to read one

    if not torch_files.is_torch_file(head):
        return [describe(path)]
    found = []
    for where, state in _scaler_states(torch_files.load(path), name):
        try:
            parsed = _parse(torch_files.plain(state))
        except StateDictError as exc:
            raise StateDictError(f"{name}: {where}: {exc}") from None
        info = _info(path, *parsed)
        found.append(info | {"format": info["format"].replace("(JSON)", "(torch.save)"), "where": where})
    if not found:
        raise StateDictError(
            f"{name} is a torch.save file with no scaler state in it (no dict with torch's GradScaler "
            "keys, paddle's, or polyamp's 'format'). Fix: pass the file the scaler was saved in (a "
            "training checkpoint's scaler entry, Lightning's .ckpt, accelerate's scaler.pt)."
        )
    return found


def _check_path(path: str) -> str:
    """The path's name for messages, once it is a regular file (``checkpoint.regular_file``)."""
    return regular_file(path, path_fix="the checkpoint's", dir_fix="the checkpoint file",
                        special_fix="polyamp inspect reads checkpoint files only. Fix: save the stream to a "
                                    "file and pass that file.")


def _scaler_states(obj: Any, name: str) -> list[tuple[str, dict[Any, Any]]]:
    """``(path, state)`` for each scaler state nested in ``obj``, in the file's order; each container
    walked once, StateDictError past MAX_DEPTH or MAX_ITEMS."""
    found, seen, items = [], set(), 0
    containers = (dict, list, tuple)
    stack: list[tuple[Any, str, int]] = [(obj, "checkpoint", 0)] if isinstance(obj, containers) else []
    while stack:
        node, where, depth = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, dict) and _is_state(node):
            found.append((where, node))
            continue
        items += len(node)
        if items > MAX_ITEMS or depth >= MAX_DEPTH:
            raise StateDictError(
                f"{name} is a torch.save file too large or too deeply nested to search for scaler "
                f"states: polyamp inspect walks at most {MAX_ITEMS:,} items, {MAX_DEPTH} levels deep "
                f"(it stopped at {where[:200]}). Fix: save the scaler state on its own "
                "(torch.save(scaler.state_dict(), f)) and inspect that file."
            )
        entries = node.items() if isinstance(node, dict) else enumerate(node)
        inner = [(value, where + f"[{key!r}]".replace("'", '"'), depth + 1) for key, value in entries
                 if isinstance(value, containers)]
        stack.extend(reversed(inner))  # popped in the file's order
    return found


def _is_state(candidate: dict[Any, Any]) -> bool:
    """Whether a dict found in a torch.save file is a scaler state (polyamp's, torch's or paddle's)."""
    from polyamp.compat._paddle_state import PADDLE_KEYS
    from polyamp.compat._torch_state import TORCH_KEYS

    return candidate.get("format") == checkpoint.FORMAT or all(k in candidate for k in TORCH_KEYS) or all(
        k in candidate for k in PADDLE_KEYS)


def _info(path: str, kind: str, config: LossScaleConfig, host: HostState, steps: int | None,
          skipped: int | None, saved: set[str]) -> dict[str, Any]:
    """The description; ``saved``: the config fields and trackers the format holds (None or left
    out of ``config`` for the others, which ``not_saved`` lists)."""
    fields = config.to_dict()
    return {
        "path": os.fspath(path), "format": kind, "scale": host.scale,
        "growth_tracker": host.growth_tracker,
        "backoff_tracker": host.backoff_tracker if "backoff_tracker" in saved else None,
        "steps": steps, "skipped_steps": skipped,
        "config": {k: v for k, v in fields.items() if k in saved},
        "not_saved": [k for k in (*fields, "backoff_tracker") if k not in saved],
    }


def describe(path: str) -> dict[str, Any]:
    """Format, scale, trackers, step counters and config of the checkpoint at ``path``."""
    name = _check_path(path)
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
        parsed = _parse(data)
    except StateDictError as exc:
        raise StateDictError(f"{name}: {exc}") from None
    return _info(path, *parsed)


def _parse(data: dict[str, Any]) -> tuple[str, LossScaleConfig, HostState, int | None, int | None, set[str]]:
    """Format, config, state, counters (None: not saved) and what the format holds (see _info)."""
    if "format" in data:
        config, host, steps, skipped = checkpoint.from_state_dict(data)
        saved = {*config.to_dict(), "backoff_tracker"}  # polyamp's format holds every field
        return f"{checkpoint.FORMAT} version {data['version']}", config, host, steps, skipped, saved
    from polyamp.compat._paddle_state import PADDLE_KEYS, parse_paddle_state  # imports no framework
    from polyamp.compat._torch_state import TORCH_KEYS, load_torch_state

    if all(k in data for k in TORCH_KEYS):
        engine = LossScaler()
        load_torch_state(engine, data)
        saved = {k for k in _TORCH_FIELDS if k in data}
        if "_backoff_tracker" in data:  # polyamp's torch facade writes it where it is not 0
            saved.add("backoff_tracker")
        return "torch GradScaler state_dict (JSON)", engine.config, engine.host_state(), None, None, saved
    if all(k in data for k in PADDLE_KEYS):
        scale = data["scale"]
        if isinstance(scale, list) and len(scale) == 1:  # paddle's 1-element array, as JSON
            data = dict(data, scale=scale[0])
        config, scale, incr, decr = parse_paddle_state(data, LossScaleConfig())
        saved = {k for k, key in _PADDLE_FIELDS.items() if key in data} | {"backoff_tracker"}
        return "paddle GradScaler state_dict (JSON)", config, HostState(scale, incr, decr), None, None, saved
    raise StateDictError(
        f"not a checkpoint polyamp can load: no 'format' key (polyamp's own), nor torch's keys "
        f"{list(TORCH_KEYS)}, nor paddle's {list(PADDLE_KEYS)}; it has {sorted(data)[:8]}. Fix: pass a "
        "file written by LossScaler.save(), or a facade's state_dict() saved with json.dump "
        "(a torch.save file is read with torch.load(weights_only=True))."
    )


def format_text(info: dict[str, Any]) -> str:
    """The description as lines a person reads."""
    counters = (NOT_SAVED if info["steps"] is None
                else f"{info['steps']} steps, {info['skipped_steps']} skipped")
    backoff = NOT_SAVED if info["backoff_tracker"] is None else info["backoff_tracker"]
    config = ", ".join(f"{k}={v}" for k, v in info["config"].items())
    where = [f"in:       {info['where']}"] if "where" in info else []
    fields = [k for k in info["not_saved"] if k != "backoff_tracker"]
    not_saved = [f"          {NOT_SAVED}: {', '.join(fields)}"] if fields else []
    return "\n".join([
        f"file:     {info['path']}",
        *where,
        f"format:   {info['format']}",
        f"scale:    {info['scale']:g}",
        f"trackers: growth {info['growth_tracker']}, backoff {backoff}",
        f"counters: {counters}",
        f"config:   {config}",
        *not_saved,
    ])


def as_json(info: dict[str, Any] | list[dict[str, Any]]) -> str:
    """The description as JSON."""
    return json.dumps(info, indent=2, sort_keys=True)
