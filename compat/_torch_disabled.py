"""When ``GradScaler()`` is disabled: torch's rule for ``device="cuda"`` without CUDA (imports no facade)."""

from __future__ import annotations

import importlib.util
import os
import sys
import warnings

from polyamp._caller import user_stacklevel
from polyamp._registry import ENV_VAR

CUDA_MISSING = (
    "torch.cuda.amp.GradScaler is enabled, but CUDA is not available.  Disabling."  # torch's
    " (polyamp: to scale NumPy or CuPy arrays here, pass backend='numpy' or backend='cupy'.)"
)


def cuda_missing(device: str, backend: str | None) -> bool:
    """torch's rule for ``device="cuda"``: warn and disable when CUDA cannot work here. Asked only
    where the arrays may be torch's and torch is installed (imported then); else enabled."""
    chosen = backend or os.environ.get(ENV_VAR, "").strip() or None
    if device != "cuda" or chosen not in (None, "torch"):
        return False
    torch = sys.modules.get("torch")
    if torch is None:
        if importlib.util.find_spec("torch") is None:
            return False
        import torch
    if not torch.cuda.amp.common.amp_definitely_not_available():
        return False
    warnings.warn(CUDA_MISSING, stacklevel=user_stacklevel())
    return True
