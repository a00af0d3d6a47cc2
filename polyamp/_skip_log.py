"""How scale changes reach the ``polyamp`` logger, so that a long run writes a few lines, not thousands.

The first ``FIRST`` skips get one INFO line each; later ones are at DEBUG and summed up in one INFO
line per ``WINDOW`` steps that had skips (per reason under a guard). Growth is at DEBUG. No sync of
its own: the caller reads the scale only when :meth:`SkipLog.wants_scale` says so.
"""

from __future__ import annotations

import logging
import math
from collections import Counter, deque
from collections.abc import Callable
from typing import Any

logger = logging.getLogger("polyamp")

#: Skipped steps logged one line each at INFO before summaries take over.
FIRST = 3
#: Steps one summary covers, counted from the first skip it holds.
WINDOW = 1000


def scale_text(scale: float) -> str:
    """``2**14`` for a power of two (scales usually are), else ``%g``."""
    mantissa, exponent = math.frexp(scale)
    return f"2**{exponent - 1}" if mantissa == 0.5 else f"{scale:g}"


def _scale(value: Any) -> float:
    """The scale of what the caller read: a float, or a state with ``.scale`` (the paddle facade)."""
    return float(getattr(value, "scale", value))


class SkipLog:
    """One scaler's logging of scale changes; call :meth:`wants_scale` before each update and
    :meth:`after_update` after it (host counters only, unless a line is written)."""

    def __init__(self, first: int = FIRST, window: int = WINDOW) -> None:
        self.first, self.window = first, window
        self.steps = 0  # updates seen
        self.skips = 0  # skipped steps seen
        self.opened: int | None = None  # self.steps when the open window's first skip came; None: none open
        self.opening_scale: float | None = None  # the scale before that skip (None if INFO was off)
        self.reasons: Counter[str] = Counter()  # the open window's skips per reason

    def wants_scale(self, skipped: bool) -> bool:
        """Whether the caller must read the scale before this update (host-only: reads nothing)."""
        if not skipped:
            return logger.isEnabledFor(logging.DEBUG)
        if self.skips < self.first:
            return logger.isEnabledFor(logging.INFO)
        return logger.isEnabledFor(logging.DEBUG) or (
            self.opened is None and logger.isEnabledFor(logging.INFO)
        )

    def after_update(
        self, skipped: bool, before: Any, read: Callable[[], Any],
        describe: Callable[[bool, Any, Any], str | None], detail: str = "", reason: str | None = None,
    ) -> None:
        """Count this update and write its line, then a closing window's summary. ``before``: what the
        caller read if :meth:`wants_scale` said so (else None); ``read()`` reads it now, only for a line
        written; ``describe(skipped, before, after)`` words the line."""
        self.steps += 1
        level = logging.DEBUG
        if skipped:
            self.skips += 1
            if self.skips <= self.first:
                level = logging.INFO
            else:
                if self.opened is None:
                    self.opened, self.opening_scale = self.steps, None if before is None else _scale(before)
                self.reasons[reason or "overflow"] += 1
        if before is not None and logger.isEnabledFor(level):
            line = describe(skipped, before, read())
            if line is not None:
                logger.log(level, "%s%s", line, detail if skipped else "")
        if self.opened is not None and self.steps - self.opened + 1 >= self.window:
            self._summarise(read)

    def _summarise(self, read: Callable[[], Any]) -> None:
        """One INFO line for the window that closes now (one scale read), then no window is open."""
        if logger.isEnabledFor(logging.INFO):
            now = scale_text(_scale(read()))
            moved = f"{scale_text(self.opening_scale)} -> {now}" if self.opening_scale is not None else now
            reasons = self.reasons
            why = ", ".join(f"{n} {r}" for r, n in reasons.items())
            why = f" ({why})" if set(reasons) - {"overflow"} else ""
            logger.info("%d skipped steps%s in the last %d steps, loss scale %s (each step's line is at "
                        "DEBUG level)", reasons.total(), why, self.steps - self.opened + 1, moved)
        self.opened, self.opening_scale, self.reasons = None, None, Counter()


class SkipWindow:
    """The skipped steps among the last ``size`` step decisions, kept on the host (no device read)."""

    def __init__(self, size: int = WINDOW) -> None:
        self.size = size
        self.seen = 0  # decisions recorded
        self._skips: deque[int] = deque()  # the decision numbers (1-based) of skips in the window

    def record(self, skipped: bool) -> None:
        """Add one step's decision (a host bool the caller already has)."""
        self.seen += 1
        skips = self._skips
        if skipped:
            skips.append(self.seen)
        oldest = self.seen - self.size
        while skips and skips[0] <= oldest:
            skips.popleft()

    @property
    def skips(self) -> int:
        """Skipped steps among the last ``size`` decisions."""
        return len(self._skips)
