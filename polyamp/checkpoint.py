"""Versioned state dicts and atomic checkpoint files (JSON, gzip when the path ends in .gz)."""

from __future__ import annotations

import gzip
import json
import math
import os
import tempfile
from typing import Any

from ._errors import StateDictError
from .config import LossScaleConfig
from .policy import HostState

FORMAT = "polyamp.LossScaler"
VERSION = 1


def to_state_dict(
    config: LossScaleConfig, host: HostState, steps: int, skipped_steps: int
) -> dict[str, Any]:
    """The engine's checkpoint: every config field, the state and the counters."""
    return {
        "format": FORMAT,
        "version": VERSION,
        "config": config.to_dict(),
        "scale": host.scale,
        "growth_tracker": host.growth_tracker,
        "backoff_tracker": host.backoff_tracker,
        "steps": steps,
        "skipped_steps": skipped_steps,
    }


def from_state_dict(sd: Any) -> tuple[LossScaleConfig, HostState, int, int]:
    """Validate a state dict completely and return its parts; raises StateDictError."""
    if not isinstance(sd, dict):
        raise StateDictError(f"state_dict must be a dict, got {type(sd).__name__}")
    if sd.get("format") != FORMAT:
        raise StateDictError(
            f"state_dict has format={sd.get('format')!r}, expected {FORMAT!r}: it was not "
            "written by polyamp.LossScaler.state_dict() (facades load their own formats)"
        )
    version = sd.get("version")
    if not isinstance(version, int) or version > VERSION or version < 1:
        raise StateDictError(
            f"state_dict version={version!r} is not supported; this polyamp reads versions 1..{VERSION}"
        )
    missing = sorted({"config", "scale", "growth_tracker", "backoff_tracker"} - set(sd))
    if missing:
        raise StateDictError(f"state_dict lacks key(s) {missing}")
    try:
        config = LossScaleConfig.from_dict(dict(sd["config"]))
    except (TypeError, ValueError) as exc:
        raise StateDictError(f"state_dict['config'] is invalid: {exc}") from exc
    scale = _number(sd, "scale", float)
    if not (math.isfinite(scale) and scale > 0):
        raise StateDictError(f"state_dict['scale'] must be finite and > 0, got {scale!r}")
    host = HostState(scale, _count(sd, "growth_tracker"), _count(sd, "backoff_tracker"))
    return config, host, _count(sd, "steps", 0), _count(sd, "skipped_steps", 0)


def _number(sd: dict[str, Any], key: str, kind: type) -> Any:
    value = sd[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise StateDictError(f"state_dict[{key!r}] must be a number, got {value!r}")
    return kind(value)


def _count(sd: dict[str, Any], key: str, default: int | None = None) -> int:
    if key not in sd and default is not None:
        return default
    value = sd[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise StateDictError(f"state_dict[{key!r}] must be an int >= 0, got {value!r}")
    return value


def write(path: str | os.PathLike[str], state: dict[str, Any]) -> None:
    """Write ``state`` as JSON to ``path`` atomically: a temp file in the same folder, then rename."""
    path = os.fspath(path)
    payload = json.dumps(state, sort_keys=True).encode()
    if path.endswith(".gz"):
        payload = gzip.compress(payload, mtime=0)
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".polyamp-", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(payload)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def read(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a checkpoint written by :func:`write` (gzip is detected by content, not name)."""
    with open(path, "rb") as fh:
        raw = fh.read()
    if raw[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
    try:
        return json.loads(raw)
    except ValueError as exc:
        raise StateDictError(f"{os.fspath(path)!r} is not a polyamp checkpoint: {exc}") from exc
