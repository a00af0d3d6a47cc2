"""The disabled scaler: its own type, so no method has to ask "am I enabled?"."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from .config import LossScaleConfig
from .engine import StepResult


class NoOpLossScaler:
    """Same API as :class:`polyamp.LossScaler`; scales by 1 and always applies the step."""

    enabled = False
    backend = None
    state = None
    steps = 0
    skipped_steps = 0
    has_pending_check = False

    def __init__(self, config: LossScaleConfig | None = None, backend: str | None = None) -> None:
        self.config = config or LossScaleConfig()

    def scale(self, outputs: Any) -> Any:
        """``outputs`` unchanged."""
        return outputs

    def unscale_(self, grads: Iterable[Any]) -> None:
        """Nothing to undo."""
        return None

    def step(self, grads: Iterable[Any], step_fn: Callable[[], Any]) -> StepResult:
        """Run ``step_fn``; never skipped."""
        step_fn()
        self.steps += 1
        return StepResult(False, 1.0, 1.0)

    def update(self, found_inf: Any = None) -> None:
        """Nothing to update."""

    def get_scale(self) -> float:
        """Always 1.0."""
        return 1.0

    def state_dict(self) -> dict[str, Any]:
        """Empty: a disabled scaler has no state."""
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Ignored, as torch's disabled GradScaler does."""
