"""The array side of the step guard: the loss and the squared gradient norm as device values, the
vector they ride in through the step's one collective, and the one host read that brings them back.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from typing import Any, NamedTuple

import array_api_compat
import numpy as np

from ._registry import backend_of
from .backend import Backend
from .config import fits_float, short_repr
from .guard import StepGuard


def plus(total: Any, value: Any) -> Any:
    """``total + value`` of optional device values (None: nothing yet), no sync."""
    return value if total is None else total + value


#: The dtype names (after the last dot) of a real loss value: not bool, complex, object or str.
_REAL_KINDS = ("float", "int", "uint", "bfloat")


def loss_check(loss: Any, where: str) -> None:
    """Refuse a loss that is neither a real number nor an array holding one real value; reads nothing."""
    if isinstance(loss, numbers.Real) and not isinstance(loss, bool) and fits_float(loss):
        return
    shape = getattr(loss, "shape", None)
    kind = str(getattr(loss, "dtype", "")).rsplit(".", 1)[-1]  # numpy's, torch's, paddle's names alike
    if (shape is None or isinstance(loss, (bool, np.bool_)) or math.prod(tuple(shape)) != 1
            or not kind.startswith(_REAL_KINDS) or getattr(loss, "is_meta", False)):
        raise TypeError(
            f"{where} needs loss to be a real number or an array holding one value (the step's loss), "
            f"got loss={short_repr(loss)} ({type(loss).__name__}). Fix: pass e.g. loss=loss.detach()."
        )


def one_value(array: Any) -> bool:
    """Whether ``array`` holds exactly one value (a loss a facade's ``scale()`` may record)."""
    shape = getattr(array, "shape", None)
    return shape is not None and math.prod(tuple(shape)) == 1


def loss_on(scaling: Any, loss: Any, where: str) -> Any:
    """``loss`` as a 1-value array on ``scaling``'s device (or its own library's before any); no sync,
    unless it comes from another library."""
    backend = scaling.backend
    if scaling.state is None:
        backend = scaling.bind(loss) if hasattr(loss, "shape") else scaling.ready()[0]
    like = scaling.ready()[1].scale
    loss_check(loss, where)
    if isinstance(loss, numbers.Real):
        return backend.from_host(np.asarray([float(loss)], np.float64), like, None)
    detach = getattr(loss, "detach", None)  # a tensor in an autograd graph: its value only
    value = detach() if callable(detach) else loss
    if not backend.owns_array(value):
        host = np.asarray(backend_of(value).to_numpy(value), np.float64).reshape(1)
        return backend.from_host(host, like, None)
    return backend.pack([value], like)


class GuardValues(NamedTuple):
    """The guard's statistics of one step, each a slot of the vector that rides with the skip flag;
    a new statistic is one field here and its entry in :data:`SLOTS`."""

    loss: Any = None  # the step's loss (a rank without one sends 0: every rank sends the same slots)
    sumsq: Any = None  # the gradients' sum of squares (only when a norm rule is set)

    @staticmethod
    def fields(guard: StepGuard) -> tuple[str, ...]:
        """The fields ``guard`` sends, in slot order."""
        return tuple(name for name, (sent, _) in SLOTS.items() if sent(guard))

    @staticmethod
    def maxed(guard: StepGuard) -> tuple[bool, ...]:
        """Per slot sent: True where the ranks' values combine by their max, False by their sum."""
        return tuple(SLOTS[name][1] == "max" for name in GuardValues.fields(guard))

    def plus(self, **values: Any) -> GuardValues:
        """These values added to the fields named (device values, no sync)."""
        return self._replace(**{k: plus(getattr(self, k), v) for k, v in values.items()})

    def pack(self, fields: tuple[str, ...], backend: Backend, like: Any) -> Any:
        """The slots ``fields`` as one 1-d array on ``like``'s device (0 for a value not seen)."""
        parts = [getattr(self, name) for name in fields]
        zero = backend.full(0.0, "float32", like) if any(p is None for p in parts) else None
        return backend.pack([zero if p is None else p for p in parts], like)

    @classmethod
    def unpack(cls, fields: tuple[str, ...], host: list[float]) -> GuardValues:
        """The host floats read back, by field (the fields not sent stay None)."""
        return cls(**dict(zip(fields, host)))

    def measured(self, given_loss: bool, ranks: int, replicated: bool) -> tuple[float | None, float | None]:
        """(loss, gradient norm) combined over ``ranks``: the mean loss; the norm from the summed
        squares (sharded gradients) or their mean (replicated ones)."""
        loss = self.loss / ranks if given_loss else None
        if self.sumsq is None:
            return loss, None
        squares = self.sumsq / ranks if replicated else self.sumsq
        return loss, (math.sqrt(squares) if not squares < 0 else math.nan)


#: field -> (whether a guard sends it, how the ranks' values combine: "sum" or "max")
SLOTS: dict[str, tuple[Callable[[StepGuard], bool], str]] = {
    "loss": (lambda guard: True, "sum"),
    "sumsq": (lambda guard: guard.watches_norm, "sum"),
}
#: The most slots a guard sends (the agreement's room for them).
MOST = len(SLOTS)


def read(backend: Backend, flag: Any, sent: Any) -> tuple[bool, list[float]]:
    """The skip flag and the guard values in ONE host read (one small array packed on the device)."""
    if isinstance(flag, bool):
        return flag, np.asarray(backend.to_numpy(sent), np.float64).reshape(-1).tolist()
    host = np.asarray(backend.to_numpy(backend.pack([flag, sent], sent)), np.float64).reshape(-1).tolist()
    return host[0] != 0, host[1:]


def joined(extra: Any, sent: Any) -> tuple[Any, int]:
    """The user's ``extra`` then the guard's values as one vector, and how many are the user's."""
    if sent is None or extra is None:
        return (sent if extra is None else extra), (0 if extra is None else math.prod(tuple(extra.shape)))
    xp = array_api_compat.array_namespace(sent)
    mine = xp.reshape(xp.astype(extra, sent.dtype), (-1,))
    return xp.concat([mine, sent]), mine.shape[0]


def split(agreed: Any, users: int, extra: Any, sent: Any) -> tuple[Any, Any]:
    """The agreed vector of :func:`joined` back into (the user's extra, the guard's values)."""
    if sent is None:
        return agreed, None
    if extra is None:
        return None, agreed
    xp = array_api_compat.array_namespace(agreed)
    return xp.reshape(xp.astype(agreed[:users], extra.dtype), tuple(extra.shape)), agreed[users:]
