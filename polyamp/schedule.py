"""Stepping an LR scheduler only after an applied optimizer step: a skipped step should not advance
the schedule (torch warns "Detected call of lr_scheduler.step() before optimizer.step()")."""

from __future__ import annotations

from typing import Any


def step_if_applied(scheduler: Any, skipped: bool | None, *args: Any, **kwargs: Any) -> bool:
    """Call ``scheduler.step()`` unless the last optimizer step was skipped; True if it ran."""
    if skipped:
        return False
    scheduler.step(*args, **kwargs)
    return True
