"""The disabled scaler: its own type, so no method has to ask "am I enabled?"."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from .config import LossScaleConfig, config_from
from .engine import ScalerStateError, StepResult
from .overflow import check_diagnose


class NoOpLossScaler:
    """Same API and loop order as :class:`polyamp.LossScaler` (so code written against it keeps
    working when scaling is turned on); scales by 1 and always applies the step. Copyable, picklable."""

    enabled = False
    backend = None
    state = None
    steps = 0
    skipped_steps = 0
    has_pending_check = False

    last_overflow = None  # it never skips, so it has nothing to report

    def __init__(
        self, config: LossScaleConfig | None = None, backend: str | None = None, *, reducer: Any = None,
        diagnose: bool = False, **fields: Any,
    ) -> None:
        """LossScaler's signature; ``reducer`` and ``diagnose`` are accepted (checked) and unused:
        a disabled scaler applies every step on every rank and skips nothing to report."""
        check_diagnose(diagnose)
        self.config = config_from(config, fields, type(self).__name__)
        self._unscaled = self._stepped = False

    def scale(self, outputs: Any) -> Any:
        """``outputs`` unchanged."""
        return outputs

    def unscale_(self, grads: Iterable[Any], *, check_only: bool = False) -> None:
        """Nothing to undo; once per iteration, before step(), as on LossScaler."""
        if self._stepped or self._unscaled:
            raise ScalerStateError("unscale_() was already called (or step() was) in this iteration. Fix: "
                                   "remove the second unscale_() call, and call update() after step().")
        self._unscaled = True

    def step(self, grads: Iterable[Any], step_fn: Callable[[], Any]) -> StepResult:
        """Run ``step_fn``; never skipped (the result is truthy). Call update() next."""
        if self._stepped:
            raise ScalerStateError("step() was already called in this iteration. Fix: call update() after "
                                   "step() (the loop is `stepped = scaler.step(grads, step_fn); "
                                   "scaler.update()`).")
        step_fn()
        self._stepped = True
        self.steps += 1
        return StepResult(False, 1.0)

    def update(self, found_inf: Any = None) -> None:
        """Ends the iteration; the scale stays 1."""
        self._unscaled = self._stepped = False

    def get_scale(self) -> float:
        """Always 1.0."""
        return 1.0

    def metrics(self, *, diagnose: bool = False) -> dict[str, float | int]:
        """Empty: a disabled scaler scales nothing and skips nothing (as a disabled GradScaler's)."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        """Empty: a disabled scaler has no state."""
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Ignored, as torch's disabled GradScaler does."""
