"""Versioned state dicts and checkpoint files: a path (atomic; gzip when it ends in .gz) or a binary file.

Reading detects gzip by content and caps what is read at :data:`MAX_BYTES`; failures name the file.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import stat
import zlib
from typing import IO, Any

from . import _foreign_state
from ._atomic_file import atomic_write
from ._errors import StateDictError
from .config import LossScaleConfig, check_scale, short_repr
from .guard import GuardHistory
from .policy import HostState, fit_to_config, tracker_limits

FORMAT = "polyamp.LossScaler"
VERSION = 1
#: The most a checkpoint may hold, after decompression (a real one is under 1 KiB): 16 MiB.
MAX_BYTES = 16 * 2**20
#: The scale trackers are int32 on the device; a loaded one must stay below this.
TRACKER_LIMIT = 2**31
#: steps and skipped_steps are host ints; below this they fit an int64 anywhere.
COUNTER_LIMIT = 2**63
_GZIP_MAGIC = b"\x1f\x8b"

Target = str | os.PathLike[str] | IO[bytes]


# -- state dicts ------------------------------------------------------------------------
def to_state_dict(
    config: LossScaleConfig, host: HostState, steps: int, skipped_steps: int,
    guard: GuardHistory | None = None,
) -> dict[str, Any]:
    """The engine's checkpoint: config, state, counters and a StepGuard's history (``"guard"``);
    trackers past the config's limits are written fitted (the same trajectory), so it loads."""
    host = fit_to_config(host, config)
    extra = {} if guard is None else {"guard": guard.to_dict()}
    return {**extra, "format": FORMAT, "version": VERSION, "config": config.to_dict(), "scale": host.scale,
            "growth_tracker": host.growth_tracker, "backoff_tracker": host.backoff_tracker, "steps": steps,
            "skipped_steps": skipped_steps}


def from_state_dict(sd: Any) -> tuple[LossScaleConfig, HostState, int, int]:
    """Validate a state dict completely and return its parts; raises StateDictError."""
    if not isinstance(sd, dict):
        raise StateDictError(f"state_dict must be a dict, got {type(sd).__name__}")
    if sd.get("format") != FORMAT:
        raise _not_ours(sd)
    version = sd.get("version")
    if isinstance(version, bool) or not isinstance(version, int) or version > VERSION or version < 1:
        raise StateDictError("state_dict['version'] must be an int this polyamp reads "
                             f"(1..{VERSION}), got version={short_repr(version)}. Fix: "
                             "load a state_dict written by LossScaler.state_dict() (a "
                             "newer polyamp's checkpoint needs that newer polyamp).")
    missing = sorted({"config", "scale", "growth_tracker", "backoff_tracker"} - set(sd))
    if missing:
        raise StateDictError(f"state_dict lacks key(s) {missing}")
    try:
        config = LossScaleConfig.from_dict(dict(sd["config"]))
    except (TypeError, ValueError, OverflowError) as exc:
        raise StateDictError(f"state_dict['config'] is invalid: {exc}") from exc
    scale = check_scale("state_dict['scale']", sd["scale"], StateDictError)
    most_growth, most_backoff = tracker_limits(config)  # the rule's largest trackers
    growth = _count(sd, "growth_tracker", min(most_growth + 1, TRACKER_LIMIT),
                    f"<= {most_growth} (config growth_interval={config.growth_interval}, "
                    f"rule={config.rule!r}) and below 2**31 (int32)")
    backoff = _count(sd, "backoff_tracker", min(most_backoff + 1, TRACKER_LIMIT),
                     f"<= {most_backoff} (config backoff_interval={config.backoff_interval}, "
                     f"rule={config.rule!r}) and below 2**31 (int32)")
    steps = _count(sd, "steps", COUNTER_LIMIT, "below 2**63", default=0)
    skipped = _count(sd, "skipped_steps", COUNTER_LIMIT, "below 2**63", default=0)
    if skipped > steps:
        raise StateDictError("state_dict['skipped_steps'] must not exceed state_dict['steps'] "
                             "(skipped steps are counted among the steps), got "
                             f"skipped_steps={skipped} and steps={steps}. Fix: load a state_dict "
                             "written by LossScaler.state_dict(), or correct those counters.")
    return config, HostState(scale, growth, backoff), steps, skipped


def _not_ours(sd: dict[str, Any]) -> StateDictError:
    """The error for a dict of another format (naming a foreign scaler's layout and how to load it)."""
    foreign = _foreign_state.layout(sd)
    fix = "" if foreign is None else (
        f". It is {foreign}'s own scaler state: load it with LossScaler.load_state_dict(sd) on a scaler "
        f"built with that run's settings (it is read with rule={foreign!r}; docs/checkpoints.md)")
    return StateDictError(f"state_dict has format={short_repr(sd.get('format'))}, expected {FORMAT!r}: it "
                          f"was not written by polyamp.LossScaler.state_dict() (facades load their own "
                          f"formats){fix}")


def guard_history(sd: dict[str, Any]) -> GuardHistory | None:
    """A state dict's StepGuard histories and streak, validated; None when it has none (older ones)."""
    return GuardHistory.from_dict(sd["guard"]) if "guard" in sd else None


def of_iteration(iteration: Any) -> dict[str, Any]:
    """:func:`to_state_dict` of a scaler's :class:`polyamp._iteration.Iteration` as it is now (a sync)."""
    guarding = iteration.guarding
    history = None if guarding is None else guarding.history_of(0)
    return to_state_dict(iteration.scaling.config, iteration.scaling.host_state(), iteration.steps,
                         iteration.skipped_steps, history)


def load_into(iteration: Any, sd: Any) -> None:
    """Load a state dict (polyamp's, Megatron-Core's or DeepSpeed's) into ``iteration``, validated
    whole before anything changes."""
    if _foreign_state.layout(sd) is not None:
        sd = _foreign_state.to_polyamp(sd, of_iteration(iteration))
    apply(iteration, (*from_state_dict(sd), guard_history(sd)))


def apply(iteration: Any, parts: tuple[LossScaleConfig, HostState, int, int, GuardHistory | None]) -> None:
    """Load validated ``parts`` (config, state, counters, guard history) into ``iteration``; a guard's
    history is fitted to its window (empty from a checkpoint saved without one)."""
    config, host, steps, skipped, history = parts
    iteration.steps, iteration.skipped_steps = steps, skipped
    iteration.load(config, host)
    if iteration.agreement is not None:  # the meter's phase may have moved: announced at its next sample
        iteration.agreement.forget_meter()
    if iteration.guarding is not None:
        iteration.histories = {0: (history or GuardHistory()).fitted(iteration.guarding.guard.window)}


def _count(sd: dict[str, Any], key: str, limit: int, rule: str, default: int | None = None) -> int:
    """``sd[key]`` as an int in [0, limit); StateDictError naming the key otherwise."""
    if key not in sd and default is not None:
        return default
    value = sd[key]
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < limit:
        raise StateDictError(f"state_dict[{key!r}] must be an int >= 0 {rule}, got "
                             f"{key}={short_repr(value)}. Fix: load a state_dict "
                             "written by LossScaler.state_dict() with this config.")
    return value


# -- writing ----------------------------------------------------------------------------
def write(f: Target, state: dict[str, Any]) -> None:
    """Write ``state`` as JSON to a binary file object, or atomically to a path (gzip for .gz/.GZ)."""
    payload = json.dumps(state, sort_keys=True).encode()  # fails before any file is touched
    if hasattr(f, "write"):
        if isinstance(f, io.TextIOBase):
            raise TypeError(f"save() needs a binary file, got text file {_name(f)}. Fix: open it with 'wb'.")
        _write_all(f, payload)
        return
    path = _as_path(f, "save")
    if path.lower().endswith(".gz"):
        payload = gzip.compress(payload, mtime=0)
    atomic_write(path, payload)


def _write_all(f: IO[bytes], payload: bytes) -> None:
    """``f.write`` until every byte is taken: a raw file may take fewer bytes per call; one that
    takes none (or says it took more than given) raises OSError naming the file."""
    view, done = memoryview(payload), 0
    while done < len(payload):
        n = f.write(view[done:])
        if n is None and done == 0:  # a writer that does not count (returns None) took it all
            return
        if not isinstance(n, int) or not 0 < n <= len(payload) - done:
            raise OSError(f"save() could not write checkpoint {_name(f)}: its write() took {n!r} of the "
                          f"{len(payload) - done} bytes left ({done} of {len(payload)} written), so the file "
                          "is incomplete. Fix: save to a path (written atomically), or to a file whose "
                          "write() takes the bytes it is given (e.g. one opened with open(path, 'wb')).")
        done += n


def _as_path(f: Any, verb: str) -> str:
    if not isinstance(f, (str, os.PathLike)):
        raise TypeError(f"{verb}() needs a path or a binary file object, got "
                        f"f={short_repr(f)} ({type(f).__name__}). Fix: pass a "
                        "str/pathlib.Path, or a file opened in binary mode.")
    return os.fspath(f)


# -- reading ----------------------------------------------------------------------------
def read(f: Target) -> dict[str, Any]:
    """The JSON object in a checkpoint file (gzip detected by content); StateDictError naming it."""
    name = _name(f)
    raw = _read_capped(f, name)
    if raw[:2] == _GZIP_MAGIC:
        raw = _gunzip(raw, name)
    try:
        return json.loads(raw, object_pairs_hook=_unique_keys)
    except _DuplicateKey as exc:
        raise StateDictError(f"{name} is not a valid polyamp checkpoint: key {exc.args[0]!r} appears "
                             "twice in one JSON object, so which value holds is ambiguous. Fix: load "
                             "a file written by LossScaler.save(), or remove the repeated key.") from None
    except (ValueError, RecursionError) as exc:
        raise StateDictError(f"{name} is not a polyamp checkpoint: not valid JSON ({type(exc).__name__}: "
                             f"{str(exc)[:200]}). Fix: load a file written by LossScaler.save().") from exc


class _DuplicateKey(Exception):
    """A JSON object with a repeated key (json.loads would keep the last one silently)."""


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise _DuplicateKey(key)
        result[key] = value
    return result


def load(f: Target, *, with_guard: bool = False) -> Any:
    """Read and validate a checkpoint; every StateDictError names the file. ``with_guard``: the
    parts and then :func:`guard_history`'s value."""
    data = read(f)
    try:
        parts = from_state_dict(data)
        return (*parts, guard_history(data)) if with_guard else parts
    except StateDictError as exc:
        raise StateDictError(f"{_name(f)}: {exc}") from exc


def _name(f: Any) -> str:
    if isinstance(f, (str, os.PathLike)):
        return repr(os.fspath(f))
    name = getattr(f, "name", None)
    return repr(name) if isinstance(name, (str, bytes)) else f"<{type(f).__name__} object>"


def _read_capped(f: Target, name: str) -> bytes:
    if hasattr(f, "read"):
        raw = f.read(MAX_BYTES + 1)
        if isinstance(raw, str):
            raise TypeError(f"load() needs a binary file, got text file {name}. Fix: open it with 'rb'.")
    else:
        path = _as_path(f, "load")
        _refuse_special(path, name)
        with open(path, "rb") as fh:
            raw = fh.read(MAX_BYTES + 1)
    if len(raw) > MAX_BYTES:
        raise StateDictError(f"{name} is larger than {MAX_BYTES} bytes: not a polyamp checkpoint.")
    return raw


def _refuse_special(path: str, name: str) -> None:
    """Refuse a FIFO, socket or device before opening it (a FIFO would block); a missing file is open()'s."""
    try:
        kind = special_kind(os.stat(path).st_mode)
    except OSError:
        kind = None
    if kind is not None:
        raise StateDictError(f"load() got {name}, which is {kind}, not a regular file: polyamp reads "
                             "checkpoints from regular files (a pipe would block until something "
                             "writes to it). Fix: pass the path of the file LossScaler.save() "
                             "wrote, or open the stream yourself and pass the binary file object.")


def regular_file(path: Any, *, path_fix: str, dir_fix: str, special_fix: str) -> str:
    """The path's name for messages, once ``os.stat`` says it is an existing regular file (a FIFO
    would block); StateDictError otherwise, its Fix worded by the caller."""
    name = repr(os.fspath(path))
    if "\0" in os.fsdecode(path):
        raise StateDictError(f"{name} has a NUL character in it, which no file name can hold. Fix: pass "
                             f"{path_fix} path as written on disk.")
    try:
        mode = os.stat(path).st_mode
    except OSError as exc:
        raise StateDictError(f"cannot read {name}: {exc.strerror or exc}") from None
    if stat.S_ISDIR(mode):
        raise StateDictError(f"{name} is a directory. Fix: pass {dir_fix} inside it.")
    kind = special_kind(mode)
    if kind is not None:
        raise StateDictError(f"{name} is {kind}, not a regular file: {special_fix}")
    return name


def special_kind(mode: int) -> str | None:
    """What a file of this ``st_mode`` is, for messages ("a FIFO (named pipe)"); None: a regular file."""
    if stat.S_ISREG(mode):
        return None
    return ("a folder" if stat.S_ISDIR(mode) else "a FIFO (named pipe)" if stat.S_ISFIFO(mode)
            else "a socket" if stat.S_ISSOCK(mode) else "a device or other special file")


def _gunzip(raw: bytes, name: str) -> bytes:
    """Decompress at most MAX_BYTES + 1 bytes (streaming, so a gzip bomb cannot fill memory)."""
    try:
        with gzip.GzipFile(fileobj=io.BytesIO(raw)) as fh:
            data = fh.read(MAX_BYTES + 1)
    except (OSError, EOFError, zlib.error) as exc:
        raise StateDictError(
            f"{name} is not a readable gzip file ({type(exc).__name__}: {exc}): truncated or "
            "corrupt. Fix: load an intact checkpoint written by LossScaler.save()."
        ) from exc
    if len(data) > MAX_BYTES:
        raise StateDictError(f"{name} decompresses to more than {MAX_BYTES} bytes (16 "
                             "MiB): not a polyamp checkpoint (a real one is under 1 KiB).")
    return data
