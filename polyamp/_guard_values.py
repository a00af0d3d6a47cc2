"""The array side of the step guard: the loss and the squared gradient norm as device values, the
vector they ride in through the step's one collective, and the one host read that brings them back
with the skip flag. The rule itself is :mod:`polyamp.guard`'s (plain Python on the values read).
Array work goes through the backend's hooks (``sum_of_squares``, ``pack``), so any library works.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any

import array_api_compat
import numpy as np

from ._registry import backend_of
from .backend import Backend
from .config import fits_float, short_repr
from .guard import StepGuard


def plus(total: Any, value: Any) -> Any:
    """``total + value`` of optional device values (None: nothing yet), no sync."""
    return value if total is None else total + value


#: The dtype names (after the last dot: numpy's, torch's, paddle's alike) of a real loss value:
#: not bool, complex, object or str.
_REAL_KINDS = ("float", "int", "uint", "bfloat")


def loss_check(loss: Any, where: str) -> None:
    """Refuse a loss that is neither a real number (within float64's range) nor an array holding one
    real value (not bool, not complex); reads nothing."""
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


def loss_value(loss: Any, backend: Backend, like: Any, where: str) -> Any:
    """``loss`` (a real number or a one-value array) as a 1-value array on ``like``'s device (no
    sync, unless it comes from another library: then one read of it)."""
    loss_check(loss, where)
    if isinstance(loss, numbers.Real):
        return backend.from_host(np.asarray([float(loss)], np.float64), like, None)
    detach = getattr(loss, "detach", None)  # a tensor in an autograd graph: its value only
    value = detach() if callable(detach) else loss
    if not backend.owns_array(value):
        host = np.asarray(backend_of(value).to_numpy(value), np.float64).reshape(1)
        return backend.from_host(host, like, None)
    return backend.pack([value], like)


def squared_norm(backend: Backend, arrays: Sequence[Any]) -> Any:
    """The sum of squares of one group of unscaled gradients, 0-d on their device (no sync)."""
    return backend.sum_of_squares(arrays)


def values(backend: Backend, guard: StepGuard, loss: Any, sumsq: Any, like: Any) -> Any:
    """This rank's guard values as one 1-d array on ``like``'s device: [loss, sum of squares?]
    (the loss slot always, 0 when none was given, so every rank sends the same number of values
    whether or not it gave a loss; the squares when a norm rule is set: 0 from a rank without
    gradients)."""
    zero = None if loss is not None and sumsq is not None else backend.full(0.0, "float32", like)
    parts = [zero if loss is None else loss]
    if guard.watches_norm:
        parts.append(zero if sumsq is None else sumsq)
    return backend.pack(parts, like)


def read(backend: Backend, flag: Any, sent: Any) -> tuple[bool, list[float]]:
    """The skip flag and the guard values in ONE host read (one small array packed on the device)."""
    if sent is None:
        return (flag if isinstance(flag, bool) else bool(backend.read_flag(flag))), []
    if isinstance(flag, bool):
        host = np.asarray(backend.to_numpy(sent), np.float64).reshape(-1)
        return flag, [float(v) for v in host]
    host = np.asarray(backend.to_numpy(backend.pack([flag, sent], sent)), np.float64).reshape(-1)
    return bool(host[0] != 0), [float(v) for v in host[1:]]


def unpack(guard: StepGuard, given_loss: bool, host: list[float], ranks: int, replicated: bool
           ) -> tuple[float | None, float | None]:
    """(loss, gradient norm) from the summed values read: the loss the ranks' mean; the norm the
    root of the summed squares (sharded gradients), or of their mean (replicated ones)."""
    loss = host[0] / ranks if given_loss else None  # the loss slot is sent always (values())
    norm = None
    if guard.watches_norm:
        squares = host[1] / ranks if replicated else host[1]
        norm = math.sqrt(squares) if not squares < 0 else math.nan
    return loss, norm


def joined(extra: Any, sent: Any) -> tuple[Any, int]:
    """The user's ``extra`` (clipping's) then the guard's values, as one vector for the agreement;
    and how many values are the user's (array-API libraries: clipping works on those only)."""
    if sent is None or extra is None:
        return (sent if extra is None else extra), (0 if extra is None else math.prod(tuple(extra.shape)))
    xp = array_api_compat.array_namespace(sent)
    mine = xp.reshape(xp.astype(extra, sent.dtype), (-1,))
    return xp.concat([mine, sent]), mine.shape[0]


def split(agreed: Any, users: int, extra: Any, sent: Any) -> tuple[Any, Any]:
    """The agreed vector of :func:`joined` back into (the user's extra in its dtype and shape, the
    guard's values)."""
    if sent is None:
        return agreed, None
    if extra is None:
        return None, agreed
    xp = array_api_compat.array_namespace(agreed)
    return xp.reshape(xp.astype(agreed[:users], extra.dtype), tuple(extra.shape)), agreed[users:]
