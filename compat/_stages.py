"""The per-optimizer stage checks torch's and paddle's scalers share, with their (identical) messages;
they go by the stage's name, so each facade keeps its own enum."""

from __future__ import annotations

from enum import Enum


def check_unscale(stage: Enum) -> None:
    """RuntimeError, as torch and paddle raise it, unless ``unscale_`` may run in ``stage``."""
    if stage.name == "UNSCALED":
        raise RuntimeError("unscale_() has already been called on this optimizer since the last update().")
    if stage.name == "STEPPED":
        raise RuntimeError("unscale_() is being called after step().")


def check_step(stage: Enum) -> None:
    """RuntimeError, as torch and paddle raise it, unless ``step`` may run in ``stage``."""
    if stage.name == "STEPPED":
        raise RuntimeError("step() has already been called since the last update().")
