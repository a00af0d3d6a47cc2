"""The Reducer contract: in-place all-reduces over an existing engine, counted, with a deadline.

Subclasses (one module per engine) implement ``_prepare``, ``_allreduce``/``_barrier`` and
``_abort``. The base class counts collectives and retires the reducer after a fault (the ranks'
sequences of collectives no longer match); by default (``on_fault="abort"``) a fault also ends the
job, so that no late rank completes the abandoned collective alone (docs/distributed.md).
"""

from __future__ import annotations

import abc
import logging
import math
import operator
import os
import sys
import time
from collections.abc import Callable
from typing import Any, Literal, NoReturn

from .._errors import ConfigError
from ..config import short_repr
from ._errors import ReducerError, ReducerTimeoutError

#: Seconds a collective may take, where the engine has no timeout of its own (MPI, NCCL).
DEFAULT_TIMEOUT = 300.0
#: Polling a pending collective (seconds): back to back for TIGHT, then yielding the CPU between polls
#: until SPIN, then sleeping up to MAX_POLL_PAUSE between them.
TIGHT, SPIN, MAX_POLL_PAUSE = 5e-5, 2e-3, 1e-3

Op = Literal["sum", "max"]
OnFault = Literal["abort", "raise"]
ON_FAULT = ("abort", "raise")
logger = logging.getLogger("polyamp")
_yield = getattr(os, "sched_yield", lambda: time.sleep(0))
_HINT = (
    "Another rank probably hung, died, or skipped this collective (every rank must issue the same "
    "collectives in the same order: call step on every rank, also on a rank without gradients)."
)
_RETIRED = "This reducer is now unusable: restart the ranks (e.g. from the last checkpoint)."


def check_timeout(timeout: Any) -> float | None:
    """``timeout`` as float seconds (None stays None); ConfigError unless positive and finite."""
    if timeout is None:
        return None
    ok = isinstance(timeout, (int, float)) and not isinstance(timeout, bool)
    if not ok or not math.isfinite(timeout) or timeout <= 0:
        raise ConfigError(
            "timeout must be a positive, finite number of seconds (or None for the engine's "
            f"default), got timeout={short_repr(timeout)}"
        )
    return float(timeout)


def check_on_fault(on_fault: Any) -> OnFault:
    """``on_fault`` checked: "abort" (end the job after a fault) or "raise" (only raise)."""
    if not isinstance(on_fault, str) or on_fault not in ON_FAULT:
        raise ConfigError(
            f"on_fault must be 'abort' (a timeout or dead peer ends the job, so no rank can complete "
            f"the abandoned step alone) or 'raise' (raise only; a late rank may then complete it), "
            f"got on_fault={short_repr(on_fault)}"
        )
    return on_fault  # type: ignore[return-value]


def wait_until(done: Callable[[], bool], timeout: float) -> bool:
    """Poll ``done()`` until it returns True (then True) or ``timeout`` seconds pass (then False).

    A fast collective costs no yield, a slow one little CPU (``TIGHT``, ``SPIN``, ``MAX_POLL_PAUSE``).
    """
    start = time.monotonic()
    deadline, tight_until, spin_until = start + timeout, start + TIGHT, start + SPIN
    pause = 0.0
    while not done():
        now = time.monotonic()
        if now >= deadline:
            return done()
        if now < tight_until:
            continue
        if now < spin_until:
            _yield()  # time.sleep(0) would cost tens of microseconds (timer slack)
        else:
            pause = min(max(2.0 * pause, 1e-5), MAX_POLL_PAUSE)
            time.sleep(pause)
    return True


class Reducer(abc.ABC):
    """All-reduces arrays in place across the ranks of one group, one collective per call.

    ``name``: the engine ("mpi", "torch:gloo", ...); ``rank``/``size``: this process's place in the
    group; ``timeout``: seconds a collective may take (None: the engine's own limit); ``on_fault``:
    see the module docstring.
    """

    def __init__(self, name: str, rank: int, size: int, timeout: float | None) -> None:
        try:
            valid = not isinstance(rank, bool) and 0 <= operator.index(rank) < operator.index(size)
        except TypeError:  # not an integer
            valid = False
        if not valid:
            raise ConfigError(
                f"reducer {name!r}: rank={rank!r} is not within the group's ranks 0 to size - 1 "
                f"(size={size!r}). Fix: give this process's rank within the reducer's group (the "
                "agreement's message counts on every rank of 0 .. size - 1 taking part), not a global rank."
            )
        self.name, self.rank, self.size, self.timeout = name, int(rank), int(size), timeout
        self._collectives = 0
        self._retired: str | None = None
        self.on_fault: OnFault = "abort"

    def group_key(self) -> Any:
        """The object that stands for this reducer's group of ranks (the engine's communicator or
        process group): two reducers with one key share its collectives. Default: the reducer."""
        return self

    @property
    def collectives(self) -> int:
        """The number of collectives issued so far (a refused array issues none)."""
        return self._collectives

    def allreduce_sum_(self, array: Any) -> Any:
        """Replace ``array`` on every rank by the element-wise sum over the group; returns it."""
        return self._issue(array, "sum")

    def allreduce_max_(self, array: Any) -> Any:
        """Replace ``array`` on every rank by the element-wise maximum over the group; returns it."""
        return self._issue(array, "max")

    def barrier(self) -> None:
        """Wait until every rank of the group has reached this call (one collective)."""
        self._usable()
        self._collectives += 1
        try:
            self._barrier()
        except ReducerError as exc:
            self._failed(exc, "barrier")

    def _issue(self, array: Any, op: Op) -> Any:
        if self._retired is not None:
            self._usable()
        buffer = self._prepare(array)
        self._collectives += 1
        try:  # the per-step path: no wrapper call around the engine's collective
            self._allreduce(buffer, op)
        except ReducerError as exc:
            self._failed(exc, f"all-reduce ({op})")
        return array

    def _failed(self, exc: ReducerError, what: str) -> NoReturn:
        """A collective failed: retire the reducer (and with ``on_fault="abort"`` end the job), raise."""
        self._retired = (
            f"an earlier {what} failed ({type(exc).__name__}), so the ranks' collectives no longer "
            "match. Restart the ranks (e.g. from the last checkpoint)."
        )
        if self.on_fault == "abort":  # say why on the polyamp logger (or stderr), then end the job
            logger.error("%s: %s -- ending the job (on_fault='abort'), so that no rank can complete the "
                         "abandoned collective and apply a step the others did not.", type(exc).__name__, exc)
            for handler in (*logger.handlers, *logging.getLogger().handlers, logging.lastResort):
                if handler is not None:
                    handler.flush()
            sys.stderr.flush()
            self._abort()
        raise exc

    def retire(self, reason: str) -> None:
        """Make every later collective raise ReducerError, saying ``reason`` (e.g. misaligned ranks)."""
        self._retired = reason

    def _usable(self) -> None:
        if self._retired is not None:
            raise ReducerError(f"{self.describe()} cannot issue another collective: {self._retired}")

    def describe(self) -> str:
        """'polyamp reducer NAME (rank R of N)': how messages name this reducer."""
        return f"polyamp reducer {self.name!r} (rank {self.rank} of {self.size})"

    def timeout_error(self, what: str, limit: str | None = None) -> ReducerTimeoutError:
        """The error for a collective that did not complete within ``limit`` (default: ``timeout``)."""
        if limit is None:
            limit = f"timeout={self.timeout:g} s (polyamp.distributed.reducer(..., timeout=))"
        return ReducerTimeoutError(f"{self.describe()}: {what} did not complete within {limit}. {_HINT} "
                                   f"{_RETIRED}")

    def fault_error(self, what: str, cause: str, detail: str) -> ReducerError:
        """The error for a collective that failed for ``cause`` (e.g. 'a peer rank probably died')."""
        return ReducerError(f"{self.describe()}: {what} failed: {cause}. {_RETIRED} Engine said: {detail}")

    def __copy__(self) -> Reducer:
        """Itself: a communicator cannot be duplicated, so copies of a scaler share its reducer."""
        return self

    def __deepcopy__(self, memo: dict) -> Reducer:
        """Itself, as :meth:`__copy__`."""
        return self

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError(
            f"{self.describe()} cannot be pickled: it stands for a live communicator of this process. "
            "Fix: pickle the scaler's state_dict() instead, and build the scaler in the new process "
            "with its own reducer= there."
        )

    def __repr__(self) -> str:
        limit = "engine default" if self.timeout is None else f"{self.timeout:g} s"
        return (f"<{type(self).__name__} {self.name!r} rank {self.rank} of {self.size}, "
                f"timeout {limit}, {self._collectives} collectives>")

    @abc.abstractmethod
    def _prepare(self, array: Any) -> Any:
        """``array`` or a zero-copy view of it; ForeignArrayError when it cannot be reduced in place."""

    @abc.abstractmethod
    def _allreduce(self, buffer: Any, op: Op) -> None:
        """Issue one all-reduce of ``buffer`` in place (done for any later reader on its device);
        ReducerError on a fault."""

    @abc.abstractmethod
    def _barrier(self) -> None:
        """Issue one barrier and wait for it; ReducerError on a fault."""

    def _abort(self) -> None:  # noqa: B027 - optional: an engine without an abort only raises
        """End the job after a fault the way the engine does (default: nothing, the error is raised)."""
