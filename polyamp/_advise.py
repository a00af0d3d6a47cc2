"""``polyamp advise FILE``: the precision report of gradients saved to a file; nothing in it is executed
(``np.load(allow_pickle=False)``, ``torch.load(weights_only=True)``).
"""

from __future__ import annotations

import math
import zipfile
from collections.abc import Sequence
from typing import Any

import numpy as np

from ._errors import ConfigError, StateDictError
from .checkpoint import regular_file
from .precision import PrecisionMeter, PrecisionReport

__all__ = ["load_gradients", "parse_scale", "parse_targets", "report"]

#: How to write a file this command reads, for every message that refuses one.
SAVE_HINT = ("Fix: save a dict of unscaled gradients, np.savez(f, **{name: g}) or "
             "torch.save({name: p.grad for name, p in model.named_parameters()}, f).")
_FLOATS = ("float16", "float32", "float64")
_TORCH_FLOATS = ("float16", "bfloat16", "float32", "float64")


def report(path: str, scale: float, targets: Any = None) -> PrecisionReport:
    """The report of the gradients in the file at ``path`` at loss scale ``scale``."""
    meter = PrecisionMeter() if targets is None else PrecisionMeter(targets=targets)
    grads = load_gradients(path)
    from ._registry import get_backend

    counts, extremes = meter.count(get_backend("numpy"), list(grads.values()), scale)
    return meter.report(None, scale, list(grads), counts, extremes)


def load_gradients(path: str) -> dict[str, np.ndarray]:
    """name -> NumPy float array (torch's bfloat16 as float32, exactly) of the file at ``path``."""
    name = regular_file(path, path_fix="the file's", dir_fix="the gradients file",
                        special_fix="polyamp advise reads files only. Fix: save the gradients to a file and "
                                    "pass that file.")
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError as exc:
        raise StateDictError(f"cannot read {name}: {exc.strerror or exc}") from None
    if head.startswith(b"PK\x03\x04") and _is_npz(path):
        found = _npz(path, name)
    elif head.startswith(b"PK\x03\x04") or head[:1] == b"\x80":
        found = _torch(path, name)
    else:
        raise StateDictError(f"{name} is neither an np.savez file nor a torch.save file. {SAVE_HINT}")
    if not found:
        raise StateDictError(f"{name} holds no gradient arrays. {SAVE_HINT}")
    return found


def _is_npz(path: str) -> bool:
    """Whether the zip file at ``path`` is an ``np.savez`` file (every member a ``.npy``)."""
    try:
        with zipfile.ZipFile(path) as z:
            names = z.namelist()
    except (zipfile.BadZipFile, OSError, ValueError):
        return False  # the torch reader says what is wrong with it
    return bool(names) and all(n.endswith(".npy") for n in names)


def _npz(path: str, name: str) -> dict[str, np.ndarray]:
    try:
        with np.load(path, allow_pickle=False) as data:
            arrays = {key: data[key] for key in data.files}
    except Exception as exc:  # a bad zip member, an object array (refused unpickled), a truncated file
        detail = " ".join(str(exc).split())[:200]
        raise StateDictError(f"{name} could not be read as an np.savez file ({type(exc).__name__}: "
                             f"{detail}). {SAVE_HINT}") from None
    return {key: _checked(name, key, value, str(value.dtype), _FLOATS) for key, value in arrays.items()}


def _torch(path: str, name: str) -> dict[str, np.ndarray]:
    from polyamp.compat import _torch_checkpoints as torch_files  # imports torch only to read one

    data = torch_files.load(path, SAVE_HINT)
    if not isinstance(data, dict):
        raise StateDictError(f"{name} holds a {type(data).__name__}, not a dict name -> gradient. "
                             f"{SAVE_HINT}")
    found = {}
    for key, value in data.items():
        if value is None:  # a parameter without a gradient
            continue
        if not isinstance(key, str):
            raise StateDictError(f"{name} has a key {key!r:.60} that is not a str. {SAVE_HINT}")
        dtype = str(getattr(value, "dtype", type(value).__name__)).rpartition(".")[2]
        if hasattr(value, "detach") and dtype in _TORCH_FLOATS:
            try:  # a sparse or meta tensor has no NumPy values
                value = value.detach().float().numpy() if dtype == "bfloat16" else value.detach().numpy()
            except (TypeError, RuntimeError):
                raise StateDictError(
                    f"{name}: {key!r:.80} is a tensor with layout {value.layout} on device {value.device}, "
                    "whose values cannot be read. Fix: save dense CPU gradients "
                    "({name: p.grad.to_dense().cpu()}).") from None
        found[key] = _checked(name, key, value, dtype, _TORCH_FLOATS)
    return found


def _checked(name: str, key: str, value: Any, dtype: str, allowed: Sequence[str]) -> np.ndarray:
    if not isinstance(value, np.ndarray) or dtype not in allowed:
        raise StateDictError(f"{name}: {key!r:.80} is a {type(value).__name__} of dtype {dtype}, not a "
                             f"floating gradient ({', '.join(allowed)}). {SAVE_HINT}")
    return value


def parse_scale(text: str) -> float:
    """``--scale``'s value: a finite number > 0 (``65536``, ``2**16``); ConfigError otherwise."""
    base, _, power = text.partition("**")
    try:
        value = float(base) ** float(power) if power else float(text)
    except (ValueError, OverflowError):
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise ConfigError(f"--scale must be a finite number > 0 (the loss scale to judge 'loss' targets "
                          f"at), got --scale {text!r:.40}. Fix: pass e.g. --scale 65536 or --scale 2**16.")
    return value


def parse_targets(texts: Sequence[str]) -> tuple[tuple[str, str | float], ...]:
    """``--targets``' values, ``dtype[:scale]`` each (``float16``, ``bfloat16:1``,
    ``float8_e4m3fn:amax``; the scale "loss" when left out), as (dtype, scale) pairs."""
    pairs = []
    for text in texts:
        dtype, _, scale = text.partition(":")
        if not scale or scale in ("loss", "amax"):
            pairs.append((dtype, scale or "loss"))
            continue
        try:
            pairs.append((dtype, float(scale)))
        except ValueError:
            raise ConfigError(f"--targets takes dtype[:scale] entries with scale 'loss', 'amax' or a number, "
                              f"got {text!r:.60}. Fix: e.g. --targets float16 bfloat16:1 "
                              "float8_e4m3fn:amax.") from None
    return tuple(pairs)
