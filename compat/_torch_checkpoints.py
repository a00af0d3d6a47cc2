"""The scaler states inside a ``torch.save`` file, read with torch's restricted unpickler only
(``torch.load(path, weights_only=True)`` never runs code from the file). torch is imported only here.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

from polyamp._errors import StateDictError, install_hint


def is_torch_file(head: bytes) -> bool:
    """Whether a file that starts with ``head`` is a ``torch.save`` file (zip: torch >= 1.6, or a pickle)."""
    return head.startswith(b"PK\x03\x04") or head[:1] == b"\x80"


#: What to save instead, in the message refusing a file (``polyamp inspect``'s: a scaler state).
SCALER_FIX = ("Fix: save the scaler state with torch.save(scaler.state_dict(), f), or as JSON "
              "(json.dump(scaler.state_dict(), f)).")


def load(path: str, fix: str = SCALER_FIX) -> Any:
    """The object in the ``torch.save`` file at ``path`` (CPU tensors), through torch's restricted
    unpickler; StateDictError naming the file (and ``fix``) when torch is missing or the file holds code."""
    name = repr(os.fspath(path))
    try:
        import torch
    except ImportError:
        raise StateDictError(
            f"{name} is a torch.save file, and reading it needs torch (polyamp reads it with "
            f"torch.load(weights_only=True), never with a full unpickler). Fix: {install_hint('torch')} "
            "(on a machine without a GPU, install torch's CPU build first, from the index "
            "https://download.pytorch.org/whl/cpu)."
        ) from None
    try:
        with warnings.catch_warnings(), torch.serialization.safe_globals(_numpy_arrays()):
            warnings.simplefilter("ignore")  # e.g. "Detected pickle protocol 4": the unpickler's notes
            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch's UnpicklingError for anything outside its allowlist, or a bad file
        detail = " ".join(str(exc).split())[:300]
        raise StateDictError(
            f"{name} could not be read with torch.load(weights_only=True), torch's restricted unpickler "
            f"({type(exc).__name__}: {detail}). polyamp never unpickles a file fully: a checkpoint that "
            f"needs it may run code. {fix}"
        ) from None


def _numpy_arrays() -> list[Any]:
    """What NumPy arrays need beside torch's allowlist (paddle's ``scale``): numeric arrays only."""
    import numpy as np

    core = getattr(np, "_core", None) or np.core
    kinds = [getattr(np.dtypes, name) for name in ("Float16DType", "Float32DType", "Float64DType",
                                                    "Int32DType", "Int64DType", "BoolDType")
             if hasattr(getattr(np, "dtypes", None), name)]
    return [core.multiarray._reconstruct, np.ndarray, np.dtype, *kinds]


def plain(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` with 0-d and 1-element tensors as Python numbers (paddle's ``scale``, a tensor scale)."""
    out = {}
    for key, value in state.items():
        numel = getattr(value, "numel", None)
        out[key] = value.reshape(-1)[0].item() if callable(numel) and numel() == 1 else value
    return out
