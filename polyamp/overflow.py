"""Overflow forensics: which gradients hold nan/+inf/-inf, how many, and why the step was skipped.

A read-only report over any supported array library. The engine and the facades call it only
after a skipped step with ``diagnose=True``, so applied steps cost nothing. Per tensor: one
vectorised finiteness pass (the flags of a library and device read at once), then, for the
tensors that hold a non-finite value only, one more set of vectorised counts (one host read each).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import array_api_compat
import numpy as np

from .config import short_repr

__all__ = ["OverflowReport", "TensorOverflow", "explain_overflow", "floor_note", "log_summary"]


@dataclass(frozen=True)
class TensorOverflow:
    """One gradient tensor that holds a non-finite value: its counts and its largest finite magnitude."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    size: int
    nan: int
    posinf: int
    neginf: int
    max_abs_finite: float  # 0.0 when nothing in the tensor is finite

    @property
    def nonfinite(self) -> int:
        """nan + posinf + neginf."""
        return self.nan + self.posinf + self.neginf


@dataclass(frozen=True)
class OverflowReport:
    """What :func:`explain_overflow` found; truthy exactly when something was not finite.

    ``tensors``: only those holding a non-finite value, most non-finite values first (ties:
    the order given). ``diagnosis``: one line naming the likely cause and the fix.
    """

    found: bool
    checked: int
    scale: float | None
    loss_finite: bool | None
    tensors: tuple[TensorOverflow, ...]
    diagnosis: str

    def __bool__(self) -> bool:
        return self.found

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-serialisable data (shapes as lists)."""
        data = asdict(self)
        data["tensors"] = [dict(t, shape=list(t["shape"])) for t in data["tensors"]]
        return data

    def __str__(self) -> str:
        loss = {None: "loss not checked", True: "loss finite", False: "loss NOT finite"}[self.loss_finite]
        scale = "scale unknown" if self.scale is None else f"scale {self.scale:g}"
        lines = [f"overflow report: {len(self.tensors)} of {self.checked} gradient tensors hold "
                 f"inf/nan; {loss}; {scale}"]
        if self.tensors:
            rows = [("name", "shape", "dtype", "size", "nan", "+inf", "-inf", "max|finite|")]
            rows += [(t.name, str(t.shape), t.dtype, str(t.size), str(t.nan), str(t.posinf),
                      str(t.neginf), f"{t.max_abs_finite:.4g}") for t in self.tensors]
            widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
            lines += ["  " + "  ".join(c.ljust(w) if i < 3 else c.rjust(w)
                                       for i, (c, w) in enumerate(zip(r, widths))).rstrip()
                      for r in rows]
        lines.append(f"diagnosis: {self.diagnosis}")
        return "\n".join(lines)


def explain_overflow(
    grads: Sequence[Any] | Mapping[str, Any], *, names: Sequence[str] | None = None,
    loss: Any = None, scale: float | None = None,
) -> OverflowReport:
    """Which of ``grads`` (a sequence, or a mapping name -> array) hold inf/nan, and why.

    Read-only: changes no array and no scaler. ``names`` names a sequence (unnamed gradients
    are ``grads[i]``; None entries are skipped); ``loss`` (a number or 1-element array) is
    checked too. One host read per library and device, and one per tensor holding inf/nan.
    """
    named = named_arrays(grads, names)
    return build_report(named, loss=loss, scale=scale)


def named_arrays(grads: Any, names: Sequence[str] | None = None) -> list[tuple[str, Any]]:
    """``[(name, array), ...]`` from a sequence (with ``names``) or a mapping; errors name the argument."""
    if isinstance(grads, Mapping):
        if names is not None:
            raise TypeError(
                "explain_overflow got grads as a mapping and names= too; a mapping's keys are "
                "its names. Fix: leave out names=, or pass grads as a sequence."
            )
        pairs = [(str(k), v) for k, v in grads.items()]
    elif hasattr(grads, "shape") or isinstance(grads, (str, bytes)) or not hasattr(grads, "__iter__"):
        raise TypeError(
            f"grads must be a sequence of arrays or a mapping name -> array, got {short_repr(grads)} "
            f"({type(grads).__name__}). Fix: pass [grad] for one array."
        )
    else:
        grads = list(grads)
        if names is None:
            names = [f"grads[{i}]" for i in range(len(grads))]
        elif isinstance(names, str) or len(list(names)) != len(grads) or not all(
                isinstance(n, str) for n in names):
            raise ValueError(
                f"names must be a sequence of {len(grads)} str, one per gradient, got "
                f"names={short_repr(names)}. Fix: pass one name per entry of grads (or a mapping)."
            )
        pairs = list(zip(names, grads))
    for name, array in pairs:
        if array is not None and not hasattr(array, "shape"):
            raise TypeError(
                f"gradient {name!r} is not an array: got {short_repr(array)} ({type(array).__name__}). "
                "Fix: pass arrays (NumPy, torch, CuPy, paddle or array-API), or None to leave one out."
            )
    return [(name, array) for name, array in pairs if array is not None]


def build_report(
    named: list[tuple[str, Any]], *, loss: Any = None, scale: float | None = None,
    skipped: bool = False, agreed: bool = False, local_flag: bool | None = None,
) -> OverflowReport:
    """The report on ``named`` arrays. ``skipped``: the step was skipped; ``agreed``: by a flag
    summed over ranks; ``local_flag``: this rank's own flag before that sum (None: unknown)."""
    loss_finite = None if loss is None else _loss_finite(loss)
    finite = _all_finite_flags([a for _, a in named])
    bad = [_tensor_overflow(name, array) for (name, array), ok in zip(named, finite) if not ok]
    bad = [t for t in bad if t.nonfinite]  # a screen that was wrong (never, but stay exact)
    bad.sort(key=lambda t: -t.nonfinite)  # stable: ties keep the order given
    tensors = tuple(bad)
    found = bool(tensors) or loss_finite is False
    diagnosis = _diagnose(tensors, len(named), loss, loss_finite, scale, skipped, agreed, local_flag)
    return OverflowReport(found, len(named), None if scale is None else float(scale), loss_finite,
                          tensors, diagnosis)


def _diagnose(tensors: tuple[TensorOverflow, ...], checked: int, loss: Any, loss_finite: bool | None,
              scale: float | None, skipped: bool, agreed: bool, local_flag: bool | None) -> str:
    if loss_finite is False:
        return ("the loss itself is not finite: the forward pass overflowed or diverged, and no loss "
                "scale can help. Fix: find the first non-finite activation "
                "(polyamp.compat.torch.watch_forward), compute the loss in float32, or lower the "
                "learning rate.")
    at = "at this scale" if scale is None else f"at scale {scale:g}"
    if tensors and len(tensors) == checked:
        return (f"every gradient tensor holds inf/nan ({checked} of {checked}) {at}: the overflow "
                "began upstream of them (a non-finite activation or loss) or the scale is far too "
                "high. Fix: if it repeats while the scale backs off, look at the forward pass "
                "(watch_forward) and the loss, not at the scale.")
    if tensors:
        first = tensors[0].name
        return (f"{len(tensors)} of {checked} gradient tensors hold inf/nan {at} (most in {first}): "
                "normal with dynamic loss scaling, the scaler backs off and retries. Fix: nothing, "
                f"unless it repeats at every step; then look at {first}.")
    if skipped and agreed and not local_flag:
        return ("no gradient on this rank holds inf/nan, but the flag agreed over the ranks said skip: "
                "another rank overflowed. Fix: read that rank's report (diagnose=True on every rank).")
    if skipped:
        return ("no gradient holds inf/nan, but the step was skipped on a recorded flag "
                "(record_found_inf: e.g. a gradient norm that is not finite, or gradients changed "
                "after the check). Fix: check what recorded the flag, e.g. clip or norm in float32.")
    return "no overflow: every gradient" + (" and the loss" if loss is not None else "") + " is finite."


def log_summary(report: OverflowReport | None, limit: int = 3) -> str:
    """``"; inf/nan in a (2 nan), b (1 +inf)"`` for a log line (up to ``limit`` tensors), or ""."""
    if report is None:
        return ""
    if not report.tensors:
        return f"; {report.diagnosis}"
    parts = []
    for t in report.tensors[:limit]:
        counts = ", ".join(f"{n} {label}" for n, label in ((t.nan, "nan"), (t.posinf, "+inf"),
                                                           (t.neginf, "-inf")) if n)
        parts.append(f"{t.name} ({counts})")
    more = len(report.tensors) - limit
    return "; inf/nan in " + ", ".join(parts) + (f" and {more} more tensors" if more > 0 else "")


def floor_note(report: OverflowReport | None) -> str:
    """``" Last overflow report: <diagnosis>"`` for the scale-floor warning, or ""."""
    return "" if report is None else f" Last overflow report: {report.diagnosis}"


def check_diagnose(value: Any) -> bool:
    """``diagnose=`` as given, a bool; TypeError naming it otherwise."""
    if not isinstance(value, bool):
        raise TypeError(
            f"diagnose must be True or False, got diagnose={short_repr(value)} ({type(value).__name__}). "
            "Fix: pass diagnose=True to get a report on each skipped step."
        )
    return value


def name_gradients(grads: list[Any], names: list[str] | None, offset: int = 0) -> list[tuple[str, Any]]:
    """The non-None entries of ``grads`` with their names (``grads[offset + i]`` when unnamed)."""
    if names is None:
        return [(f"grads[{offset + i}]", g) for i, g in enumerate(grads) if g is not None]
    return [(n, g) for n, g in zip(names, grads) if g is not None]


# -- array work: vectorised per tensor, never in place ---------------------------------
def _is_float(array: Any) -> bool:
    name = str(array.dtype)
    return "float" in name or "complex" in name


def _dtype_name(array: Any) -> str:
    return str(array.dtype).rsplit(".", 1)[-1]


class _PaddleOps:
    """The few array-API functions used here, for paddle tensors (array-api-compat has no paddle)."""

    def __init__(self) -> None:
        self.paddle = sys.modules["paddle"]
        self.float64 = "float64"

    def isfinite(self, x: Any) -> Any:
        return self.paddle.isfinite(x)

    def isnan(self, x: Any) -> Any:
        return self.paddle.isnan(x)

    def all(self, x: Any) -> Any:
        return self.paddle.all(x)

    def count_nonzero(self, x: Any) -> Any:
        return self.paddle.sum(x.astype("int64"))

    def max(self, x: Any) -> Any:
        return self.paddle.max(x)

    def abs(self, x: Any) -> Any:  # paddle's CPU abs has no 16-bit kernel: in float32
        return self.paddle.abs(self._wide(x))

    def where(self, cond: Any, x: Any, y: Any) -> Any:
        return self.paddle.where(cond, x, y)

    def zeros_like(self, x: Any) -> Any:
        return self.paddle.zeros_like(self._wide(x))

    def _wide(self, x: Any) -> Any:
        return x.astype("float32") if str(x.dtype).endswith("16") else x

    def astype(self, x: Any, dtype: Any) -> Any:
        return x.astype(dtype)

    def stack(self, xs: list[Any]) -> Any:
        return self.paddle.stack(xs)

    def reshape(self, x: Any, shape: tuple[int, ...]) -> Any:
        return self.paddle.reshape(x, list(shape))


def _namespace(array: Any) -> Any:
    if type(array).__module__.partition(".")[0] == "paddle":
        return _PaddleOps()
    return array_api_compat.array_namespace(array)


def _host_list(array: Any) -> list[Any]:
    """A small 1-D array as Python values: one host read (a device sync on a GPU)."""
    tolist = getattr(array, "tolist", None)
    if callable(tolist):  # numpy, torch, cupy, paddle
        return tolist()
    return np.from_dlpack(array).tolist()  # array-API arrays on the host (array-api-strict)


def _device_key(array: Any) -> tuple[Any, str]:
    return type(array), str(getattr(array, "device", getattr(array, "place", "")))


def _all_finite_flags(arrays: list[Any]) -> list[bool]:
    """Per array, whether every value is finite: one pass each, flags read once per library and device."""
    groups: dict[tuple[Any, str], list[int]] = {}
    for i, array in enumerate(arrays):
        if _is_float(array) and math.prod(array.shape):
            groups.setdefault(_device_key(array), []).append(i)
    finite = [True] * len(arrays)
    for (kind, _), indices in groups.items():
        if kind.__module__.partition(".")[0] == "torch":
            flags = _torch_finite([arrays[i] for i in indices])
        else:
            xp = _namespace(arrays[indices[0]])
            flags = xp.stack([_finite_flag(xp, arrays[i]) for i in indices])
        for i, ok in zip(indices, _host_list(flags)):
            finite[i] = bool(ok)
    return finite


def _torch_finite(tensors: list[Any]) -> Any:
    """torch: one aminmax pass per tensor (nan propagates; many times faster than isfinite on
    CPU), then one stack of all the extremes (promoted to a common dtype) and one isfinite."""
    torch = sys.modules["torch"]
    extremes = torch.stack([v for t in tensors for v in t.detach().aminmax()])
    return torch.isfinite(extremes).view(-1, 2).all(1)


def _finite_flag(xp: Any, array: Any) -> Any:
    """A 0-d device bool: is every value finite. NumPy float32/64: max and min (no temporary
    array; nan propagates); otherwise one isfinite pass."""
    if isinstance(array, np.ndarray) and array.dtype.itemsize >= 4:
        return np.isfinite(array.max()) & np.isfinite(array.min())
    return xp.all(xp.isfinite(array))


def _tensor_overflow(name: str, array: Any) -> TensorOverflow:
    """The counts of one tensor: a few vectorised passes and one host read."""
    xp = _namespace(array)
    ok = xp.isfinite(array)
    nan = xp.count_nonzero(xp.isnan(array))
    posinf = xp.count_nonzero(array == math.inf)
    neginf = xp.count_nonzero(array == -math.inf)
    big = xp.max(xp.where(ok, xp.abs(array), xp.zeros_like(array)))
    f64 = xp.float64
    stats = xp.stack([xp.astype(v, f64) for v in (nan, posinf, neginf)] + [xp.astype(big, f64)])
    n_nan, n_pos, n_neg, largest = _host_list(xp.reshape(stats, (4,)))
    shape = tuple(int(s) for s in array.shape)
    return TensorOverflow(name, shape, _dtype_name(array), math.prod(shape), int(n_nan), int(n_pos),
                          int(n_neg), float(largest))


def _loss_finite(loss: Any) -> bool:
    """Whether ``loss`` (a number or 1-element array) is finite; ValueError naming ``loss`` otherwise."""
    if not hasattr(loss, "shape"):
        try:
            return math.isfinite(float(loss))
        except (TypeError, ValueError):
            raise TypeError(
                f"loss must be a number or a 1-element array, got loss={short_repr(loss)} "
                f"({type(loss).__name__}). Fix: pass the loss value, e.g. loss=loss.item()."
            ) from None
    if math.prod(tuple(loss.shape)) != 1:
        raise ValueError(
            f"loss must be a number or a 1-element array, got an array of shape {tuple(loss.shape)}. "
            "Fix: pass the reduced (scalar) loss."
        )
    xp = _namespace(loss)
    value = _host_list(xp.reshape(xp.astype(loss, xp.float64), (1,)))[0]
    return math.isfinite(float(value))
