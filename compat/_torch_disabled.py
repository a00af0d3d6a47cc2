"""When ``GradScaler()`` is disabled, and the no-op methods a disabled scaler has.

Imports nothing of the facade: ``polyamp.compat.torch`` builds the disabled type from
:class:`DisabledMethods` and its ``GradScaler``, so no two modules import each other.
Mirrors torch's disabled scaler: every method is a pass-through and nothing is validated.
Unlike torch, the getters return the values given instead of raising AttributeError.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import warnings
from typing import Any

from polyamp._caller import user_stacklevel
from polyamp._registry import ENV_VAR

CUDA_MISSING = (
    "torch.cuda.amp.GradScaler is enabled, but CUDA is not available.  Disabling."  # torch's
    " (polyamp: to scale NumPy or CuPy arrays here, pass backend='numpy' or backend='cupy'.)"
)


def cuda_missing(device: str, backend: str | None) -> bool:
    """torch's rule for ``device="cuda"``: warn and disable when CUDA cannot work here.

    Asked only when the arrays may be torch's (backend None or "torch", after
    POLYAMP_BACKEND) and torch is installed; it is imported then (at construction, never at
    ``import polyamp``), so the answer does not depend on whether torch was imported first.
    Without torch installed the scaler stays enabled: NumPy and CuPy users are not turned off.
    """
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


class DisabledMethods:
    """The no-op methods of ``GradScaler(enabled=False)`` (or device="cuda" without CUDA)."""

    _device: str
    _enabled: bool

    def __init__(self, device: str = "cuda", init_scale: float = 2.0**16,
                 growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, enabled: bool = True, **extra: Any) -> None:
        self._device = device
        self._enabled = False
        self._growth_factor, self._backoff_factor = growth_factor, backoff_factor
        self._growth_interval = growth_interval

    def scale(self, outputs: Any) -> Any:
        """``outputs`` unchanged."""
        return outputs

    def unscale_(self, optimizer: Any) -> None:
        """Nothing to undo."""
        return None

    def step(self, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        """``optimizer.step(*args, **kwargs)``, closures included, as torch's disabled scaler."""
        return optimizer.step(*args, **kwargs)

    def update(self, new_scale: Any = None) -> None:
        """Nothing to update."""
        return None

    def get_scale(self) -> float:
        """1.0, as torch's disabled scaler."""
        return 1.0

    def get_growth_factor(self) -> float:
        """The value given (torch's disabled scaler raises AttributeError instead)."""
        return self._growth_factor

    def set_growth_factor(self, new_factor: float) -> None:
        self._growth_factor = new_factor

    def get_backoff_factor(self) -> float:
        return self._backoff_factor

    def set_backoff_factor(self, new_factor: float) -> None:
        self._backoff_factor = new_factor

    def get_growth_interval(self) -> int:
        return self._growth_interval

    def set_growth_interval(self, new_interval: int) -> None:
        self._growth_interval = new_interval

    def _get_growth_tracker(self) -> int:
        return 0

    def is_enabled(self) -> bool:
        """False."""
        return False

    @property
    def skipped_steps(self) -> int:
        """Always 0: a disabled scaler never skips."""
        return 0

    @property
    def last_step_skipped(self) -> bool | None:
        """None: a disabled scaler does not track steps, so a scheduler always steps."""
        return None

    def metrics(self, *, diagnose: bool = False) -> dict[str, float | int]:
        """Empty: a disabled scaler scales nothing and skips nothing, so it has no numbers to log."""
        return {}

    @property
    def last_overflow(self) -> None:
        """None: a disabled scaler skips nothing, so it has nothing to report."""
        return None

    @property
    def engine(self) -> Any:
        """None: there is no engine behind a disabled scaler."""
        return None

    def state_dict(self) -> dict[str, Any]:
        """Empty, as torch's disabled scaler."""
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Ignored, as torch's disabled scaler."""
        return None

    def __getstate__(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return f"GradScaler(device={self._device!r}, enabled=False)"

