"""Where a deliberate warning points: the first line outside polyamp, as torch's own warnings do."""

from __future__ import annotations

import sys


def user_stacklevel() -> int:
    """The ``stacklevel`` that makes a ``warnings.warn`` in the calling function name the user's line:
    the frames of modules named ``polyamp.*`` between that function and its first caller outside."""
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and frame.f_globals.get("__name__", "").partition(".")[0] == "polyamp":
        frame, level = frame.f_back, level + 1
    return level
