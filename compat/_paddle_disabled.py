"""``GradScaler(enable=False)`` and ``AmpScaler(enable=False)``: no-op types, as paddle's disabled scalers.

Each verb passes straight to the optimizer, so no method asks "am I enabled?".
"""

from __future__ import annotations

from typing import Any

from ._paddle_steps import apply_optimizer
from .paddle import AmpScaler, GradScaler


class DisabledAmpScaler(AmpScaler):
    """``AmpScaler(enable=False)``: scale() returns its input, minimize() just minimizes."""

    _enable = False

    def scale(self, var: Any) -> Any:
        """``var`` unchanged."""
        return var

    def minimize(self, optimizer: Any, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        """``optimizer.minimize(*args, **kwargs)`` (``step()`` where there is none); never skipped."""
        return apply_optimizer(optimizer, args, kwargs)

    def _unscale(self, optimizer: Any) -> None:
        return None

    def is_use_dynamic_loss_scaling(self) -> bool:
        """Always False, as paddle's disabled scaler."""
        return False

    def state_dict(self) -> dict[str, Any]:
        """Empty: a disabled scaler has no state (paddle's returns {} too)."""
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Ignored, as paddle's disabled scaler does."""
        return None


class DisabledGradScaler(DisabledAmpScaler, GradScaler):
    """``GradScaler(enable=False)``: step() steps, update() and unscale_() do nothing."""

    def step(self, optimizer: Any) -> None:
        """``optimizer.step()``; never skipped."""
        optimizer.step()

    def update(self) -> None:
        """Nothing to update."""
        return None

    def unscale_(self, optimizer: Any) -> None:
        """Nothing to undo."""
        return None
