"""The errors of polyamp.distributed, under polyamp's own ``PolyampError``.

Hierarchy::

    PolyampError
    └── ReducerError(RuntimeError)          a collective failed; the reducer is now unusable
        ├── ReducerTimeoutError(TimeoutError)  a collective did not complete within the timeout
        ├── ReducerUnavailableError         the engine behind a reducer cannot run here
        └── RankMismatchError               the ranks' configs, states or collectives differ

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


class RankMismatchError(ReducerError):
    """The ranks are not aligned: their loss-scale configs, scale states, or sequences of
    agreements differ. Raised on every rank, in the same collective, before anything is applied;
    the message says what differed (e.g. "scale 2**10 on this rank, 2**20 on the other ranks")."""
