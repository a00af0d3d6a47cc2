"""Overflow forensics: which gradients hold nan/+inf/-inf, how many, and why the step was skipped.

Read-only; called only after a skipped step with ``diagnose=True``. Cost: one finiteness pass per
tensor (one host read per library and device), then counts for the non-finite tensors only.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from ._dtypes import short_name
from ._inputs import FLOATING
from ._registry import backend_of
from .config import fits_float, short_repr
from .guard import Verdict, VerdictFields, verdict_field

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
class OverflowReport(VerdictFields):
    """What :func:`explain_overflow` found; truthy exactly when something was not finite.

    ``tensors``: those holding a non-finite value, most first (ties: the order given).
    ``diagnosis``: the likely cause and the fix. Under a :class:`polyamp.StepGuard` the guard's
    values (``reason``, ``loss``, ``grad_norm``, ``zscores``, ``loss_spike``) come too.
    """

    found: bool
    checked: int
    scale: float | None
    loss_finite: bool | None
    tensors: tuple[TensorOverflow, ...]
    diagnosis: str
    verdict: Verdict | None = None  # the guard's, on a step skipped under a guard

    def __bool__(self) -> bool:
        return self.found

    reason = verdict_field("reason", "The guard's reason for the skip (None: skipped without a guard).")

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-serialisable data (shapes as lists; the verdict's fields flat)."""
        data = asdict(self)
        del data["verdict"]
        data["tensors"] = [dict(t, shape=list(t["shape"])) for t in data["tensors"]]
        return {**data, "reason": self.reason, "loss": self.loss, "grad_norm": self.grad_norm,
                "zscores": self.zscores, "loss_spike": self.loss_spike}

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

    Read-only. ``names`` names a sequence (default ``grads[i]``; None entries are skipped);
    ``loss`` (a number or 1-element array) is checked too.
    """
    named = named_arrays(grads, names)
    return build_report(named, loss=loss, scale=_checked_scale(scale))  # the loss checked before any read


def _checked_scale(scale: Any) -> float | None:
    """``scale`` as a float: None, or a real number (a NumPy scalar or 0-d array too), finite, > 0."""
    if scale is None:
        return None
    value = _real(scale)
    if value is None or not math.isfinite(value) or value <= 0:
        raise ValueError("scale must be a positive, finite number (the loss scale the gradients "
                         f"carry), got scale={short_repr(scale)} ({type(scale).__name__}). Fix: "
                         "pass scaler.get_scale(), or leave scale out.")
    return value


def _checked_loss(loss: Any) -> None:
    """Refuse a loss that is not a number or a 1-element array (strings, numbers beyond float64)."""
    if getattr(loss, "is_meta", False) is True:
        raise TypeError("loss is on torch's 'meta' device, which holds no value. Fix: pass the loss "
                        "computed on a real device, or leave loss= out.")
    if loss is None or hasattr(loss, "shape"):
        return
    if isinstance(loss, int) and not fits_float(loss):
        raise ValueError("loss must be a number float64 can hold or a 1-element "
                         f"array, got an int of {len(str(abs(loss)))} digits. "
                         "Fix: pass the loss as the float your model computed.")
    if _real(loss) is None:
        raise TypeError(f"loss must be a number or a 1-element array, got loss={short_repr(loss)} "
                        f"({type(loss).__name__}). Fix: pass the loss value, e.g. loss=loss.item().")


def _real(value: Any) -> float | None:
    """A real number (not bool, not a string; a NumPy scalar or 0-d array) as a float, else None."""
    if isinstance(value, (bool, str, bytes)) or short_name(getattr(value, "dtype", "")) == "bool":
        return None
    if hasattr(value, "shape") and tuple(value.shape) != ():
        return None
    try:
        return float(value)
    except (TypeError, ValueError, OverflowError):
        return None


def named_arrays(grads: Any, names: Sequence[str] | None = None) -> list[tuple[str, Any]]:
    """``[(name, array), ...]`` from a sequence (with ``names``) or a mapping; errors name the argument."""
    if isinstance(grads, Mapping):
        if names is not None:
            raise TypeError("explain_overflow got grads as a mapping and names= too; a mapping's "
                            "keys are its names. Fix: leave out names=, or pass grads as a sequence.")
        pairs = [(str(k), v) for k, v in grads.items()]
    elif hasattr(grads, "shape") or isinstance(grads, (str, bytes)) or not hasattr(grads, "__iter__"):
        raise TypeError("grads must be a sequence of arrays or a mapping name -> array, got "
                        f"{short_repr(grads)} ({type(grads).__name__}). Fix: pass [grad] for one array.")
    else:
        grads = [_gradient_of(g) for g in grads]
        if names is None:
            names = [f"grads[{i}]" for i in range(len(grads))]
        elif not isinstance(names, str) and hasattr(names, "__iter__"):
            names = list(names)  # an iterator (a generator, map) is read once, here
        if isinstance(names, str) or not isinstance(names, list) or len(names) != len(grads) or not all(
                isinstance(n, str) for n in names):
            raise ValueError(f"names must be a sequence of {len(grads)} str, one "
                             f"per gradient, got names={short_repr(names)}. Fix: "
                             "pass one name per entry of grads (or a mapping).")
        pairs = list(zip(names, grads))
    for name, array in pairs:
        if array is not None and not hasattr(array, "shape"):
            raise TypeError(f"gradient {name!r} is not an array: got {short_repr(array)} "
                            f"({type(array).__name__}). Fix: pass arrays (NumPy, torch, "
                            "CuPy, paddle or array-API), or None to leave one out.")
    named = [(name, array) for name, array in pairs if array is not None]
    _check_readable(named)
    return named


def _check_readable(named: list[tuple[str, Any]]) -> None:
    """Refuse, naming the gradient, a meta or sparse tensor or a dtype outside FLOATING."""
    for name, array in named:
        problem = (
            "is on torch's 'meta' device, which holds no values" if getattr(array, "is_meta", False) is True
            else "is sparse; the counts read dense values" if getattr(array, "is_sparse", False) is True
            or "sparse" in str(getattr(array, "layout", ""))  # torch's CSR, CSC, BSR, BSC too
            else None if short_name(array.dtype) in FLOATING
            else f"has dtype {array.dtype}; only float16, bfloat16, float32 and float64 are checked"
        )
        if problem is not None:
            raise TypeError(f"explain_overflow: gradient {name!r} {problem}. Fix: pass dense floating "
                            "gradients (a sparse one's grad.coalesce().values(); torch.view_as_real(g) "
                            "for a complex one; g.float() for float8), or leave it out.")


def _gradient_of(item: Any) -> Any:
    """A parameter's ``.grad`` (as torch's utilities take ``model.parameters()``); a non-leaf
    tensor (``create_graph=True``) or any other array stands for itself."""
    if getattr(item, "is_leaf", True) is False:  # torch's: a gradient in a graph, read as its values
        return item.detach()
    if not hasattr(item, "grad"):
        return item
    own = sys.modules.get("polyamp.parameter")  # not loaded: no polyamp.Parameter exists yet
    is_parameter = ((own is not None and isinstance(item, own.Parameter))
                    or getattr(item, "requires_grad", False) is True
                    or getattr(item, "stop_gradient", True) is False)
    if not is_parameter:
        return item
    read = getattr(item, "_grad_ivar", None)  # paddle: the gradient itself, not a new wrapper
    return read() if callable(read) else item.grad


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
        raise TypeError("diagnose must be True or False, got "
                        f"diagnose={short_repr(value)} ({type(value).__name__}). Fix: "
                        "pass diagnose=True to get a report on each skipped step.")
    return value


def name_gradients(grads: list[Any], names: list[str] | None, offset: int = 0) -> list[tuple[str, Any]]:
    """The non-None entries of ``grads`` with their names (``grads[offset + i]`` when unnamed)."""
    if names is None:
        return [(f"grads[{offset + i}]", g) for i, g in enumerate(grads) if g is not None]
    return [(n, g) for n, g in zip(names, grads) if g is not None]


# -- array work: vectorised per tensor, never in place ---------------------------------
def _all_finite_flags(arrays: list[Any]) -> list[bool]:
    """Per array, whether every value is finite: flags read once per backend (``finite_flags``)."""
    groups: dict[str, tuple[Any, list[int]]] = {}
    for i, array in enumerate(arrays):
        kind = short_name(array.dtype)
        if ("float" in kind or "complex" in kind) and math.prod(array.shape):
            backend = backend_of(array)
            groups.setdefault(backend.name, (backend, []))[1].append(i)
    finite = [True] * len(arrays)
    for backend, indices in groups.values():
        for i, ok in zip(indices, backend.finite_flags([arrays[i] for i in indices])):
            finite[i] = bool(ok)
    return finite


def _tensor_overflow(name: str, array: Any) -> TensorOverflow:
    """The counts of one tensor: a few vectorised passes and one host read (its backend's)."""
    n_nan, n_pos, n_neg, largest = backend_of(array).overflow_counts(array)
    shape = tuple(int(s) for s in array.shape)
    return TensorOverflow(name, shape, short_name(array.dtype), math.prod(shape), int(n_nan), int(n_pos),
                          int(n_neg), float(largest))


def _loss_finite(loss: Any) -> bool:
    """Whether ``loss`` (a number or 1-element array) is finite; an error naming ``loss`` otherwise."""
    _checked_loss(loss)
    if not hasattr(loss, "shape"):
        return math.isfinite(float(loss))
    if math.prod(tuple(loss.shape)) != 1:
        raise ValueError("loss must be a number or a 1-element array, got an array of "
                         f"shape {tuple(loss.shape)}. Fix: pass the reduced (scalar) loss.")
    value = backend_of(loss).to_numpy(loss).reshape(-1)[0]
    return math.isfinite(float(value))
