"""The errors of polyamp.distributed, under polyamp's own ``PolyampError``.

Hierarchy::

    PolyampError
    └── ReducerError(RuntimeError)          a collective failed; the reducer is now unusable
        ├── ReducerTimeoutError(TimeoutError)  a collective did not complete within the timeout
        └── ReducerUnavailableError         the engine behind a reducer cannot run here

Bad arguments raise polyamp's ``ConfigError`` (a value) or ``ForeignArrayError`` (an array).
"""

from __future__ import annotations

from .._errors import PolyampError


class ReducerError(PolyampError, RuntimeError):
    """A collective failed (e.g. a peer rank died); the message names the reducer and the cause."""


class ReducerTimeoutError(ReducerError, TimeoutError):
    """A collective did not complete within the reducer's timeout: a rank hung, died or skipped it."""


class ReducerUnavailableError(ReducerError):
    """The engine behind a reducer cannot run here (library missing, group not initialised)."""
