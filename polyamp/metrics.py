"""A scaler's numbers for a logger, computed once for the engine and both facades.

``scaler.metrics()`` returns plain Python numbers (a dict a logger takes as it is)::

    scale                  the loss scale now                      (the one host read)
    steps                  optimizer steps taken, applied or skipped
    skipped_steps          steps skipped for inf/nan gradients
    skipped_last_1000      skipped steps among the last WINDOW (1000) steps
    last_overflow/<name>   diagnose=True: non-finite values of the last skipped step's top tensors
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ._skip_log import WINDOW, SkipWindow
from .overflow import OverflowReport

#: The tensors of the last overflow ``metrics(diagnose=True)`` names, most non-finite values first.
TOP_TENSORS = 3
#: The key of the window's count of skipped steps.
WINDOW_KEY = f"skipped_last_{WINDOW}"


def measure(iteration: Any, steps: int, skipped_steps: int, *,
            diagnose: bool = False) -> dict[str, float | int]:
    """``metrics()`` of a shell over ``iteration`` (a :class:`polyamp._iteration.Iteration`) with the
    shell's counters: one host read of the scale (none before the state is on a device)."""
    check_diagnose_flag(diagnose)
    scale, _ = read_scale(iteration)
    return scaler_metrics(scale, steps, skipped_steps, iteration.window, iteration.last_overflow,
                          diagnose=diagnose, precision=iteration.metering.last)


def read_scale(iteration: Any, pending: Sequence[Any] = ()) -> tuple[float, list[bool]]:
    """The iteration's scale (and ``pending`` device flags) on the host: ONE read (stacked on their
    device first), none before the state has arrays. Only the scale is read, not the trackers."""
    scaling = iteration.scaling
    if scaling.state is None or scaling.backend is None:
        return float(scaling.host.scale), []
    scale = scaling.state.scale
    if not pending:
        return float(scale if isinstance(scale, (int, float)) else scaling.backend.to_host(scale)), []
    import array_api_compat

    xp = array_api_compat.array_namespace(scale, *pending)
    values = [xp.astype(xp.reshape(v, (-1,))[:1], xp.float32) for v in (scale, *pending)]
    host = scaling.backend.to_numpy(xp.concat(values)).tolist()  # the one read
    return float(host[0]), [v != 0 for v in host[1:]]


def scaler_metrics(
    scale: float, steps: int, skipped_steps: int, window: SkipWindow,
    last_overflow: OverflowReport | None = None, *, diagnose: bool = False, precision: Any = None,
) -> dict[str, float | int]:
    """The dict ``metrics()`` returns, from numbers the shell has read (see the module docstring)."""
    metrics: dict[str, float | int] = {
        "scale": float(scale), "steps": int(steps), "skipped_steps": int(skipped_steps),
        WINDOW_KEY: window.skips,
    }
    if diagnose:
        metrics.update(overflow_metrics(last_overflow))
    if precision is not None:  # a PrecisionReport: the last sample step's fractions
        metrics.update(precision.fractions())
    return metrics


def overflow_metrics(report: OverflowReport | None, top: int = TOP_TENSORS) -> dict[str, int]:
    """``last_overflow/<name>``: the non-finite values of the report's first ``top`` tensors, and
    ``last_overflow/tensors``: how many tensors held any (0 without a report)."""
    if report is None:
        return {"last_overflow/tensors": 0}
    counts = {f"last_overflow/{t.name}": t.nan + t.posinf + t.neginf for t in report.tensors[:top]}
    return {"last_overflow/tensors": len(report.tensors), **counts}


def check_diagnose_flag(diagnose: Any) -> bool:
    """``diagnose`` must be a bool; TypeError naming the value and the fix otherwise."""
    if not isinstance(diagnose, bool):
        raise TypeError(f"metrics(diagnose=...) takes True or False, got diagnose={diagnose!r}. "
                        "Fix: pass diagnose=True for the last overflow's tensors.")
    return diagnose
