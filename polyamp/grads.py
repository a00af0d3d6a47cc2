"""Gradient utilities over any array library: global L2 norm, clip by global norm, and a buffer of
gradient views of one flat array. No host sync; still-scaled gradients are refused.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Sequence
from typing import Any

import array_api_compat

from . import _dtypes, _inputs
from ._errors import ConfigError, ScalerStateError
from .flat import FlatArrays

__all__ = ["GradBuffer", "ScaledGradientsError", "clip_grad_norm_", "global_norm"]


class ScaledGradientsError(ScalerStateError):
    """Gradients are still multiplied by the loss scale; unscale them before norms or clipping."""


def _engine_of(scaler: Any) -> Any:
    """The engine behind ``scaler`` (a facade's ``engine``, or the scaler itself); None for no
    scaler or a disabled torch-style facade."""
    if scaler is None:
        return None
    is_enabled = getattr(scaler, "is_enabled", None)  # the torch-style facade
    if callable(is_enabled) and not is_enabled():
        return None
    return getattr(scaler, "engine", scaler)


def _check_unscaled(scaler: Any, what: str) -> None:
    """Raise ScaledGradientsError when ``scaler`` has not unscaled this iteration's gradients."""
    engine = _engine_of(scaler)
    if engine is None:
        return
    if getattr(engine, "enabled", True) and not getattr(engine, "has_pending_check", False):
        raise ScaledGradientsError(f"{what} got gradients still multiplied by the loss scale: "
                                   f"scaler={type(scaler).__name__} has not unscaled them this "
                                   "iteration, so the norm would be ~scale times too big. Fix: "
                                   "call scaler.unscale_(grads) (or buffer.unscale_(scaler)) first.")


def _distributed_engine(scaler: Any) -> Any:
    """The enabled engine behind ``scaler`` when it has a reducer, else None."""
    engine = _engine_of(scaler)
    if not getattr(engine, "enabled", False) or getattr(engine, "reducer", None) is None:
        return None
    return engine


def _arrays(grads: Any, scaler: Any, what: str) -> list[Any]:
    """The arrays to work on (one flat array for a GradBuffer), after the still-scaled checks;
    empty only with a distributed scaler (a rank without gradients still takes part)."""
    if isinstance(grads, GradBuffer):
        if grads.scaled:
            raise ScaledGradientsError(f"{what} got a GradBuffer still multiplied by the loss scale "
                                       "(buffer.scaled is True). Fix: call buffer.unscale_(scaler) first.")
        arrays = [grads.flat]
    elif array_api_compat.is_array_api_obj(grads):
        arrays = [grads]
    else:
        arrays = [g for g in _inputs.iterable(grads, what) if g is not None]
    _inputs.check_floating(arrays, what)  # an int norm clips to 0, a complex one drops the imaginary part
    _check_unscaled(scaler, what)
    if not arrays and _distributed_engine(scaler) is None:
        raise ConfigError(f"{what} got no gradients (grads={grads!r}); pass at least one array")
    return arrays


def _namespace(arrays: Sequence[Any], what: str) -> Any:
    """The array-API namespace of ``arrays``; a TypeError naming the types when there is none."""
    try:
        return array_api_compat.array_namespace(*arrays)
    except TypeError as exc:
        kinds = sorted({type(a).__module__ + "." + type(a).__name__ for a in arrays})
        raise TypeError(
            f"{what} works on arrays of one array-API library (numpy, cupy, torch, "
            f"array_api_strict, ...) that array-api-compat supports, got {kinds} ({exc}). Fix: "
            "pass arrays of one such library, or use your framework's own gradient clipping."
        ) from exc


#: Elements per chunk of the norm's wide copy: bounds the temporary to 8 MiB of float64.
_CHUNK = 2**20


def _accumulator(xp: Any, arrays: Sequence[Any]) -> tuple[str, bool]:
    """The dtype to sum squares in, and whether values must first be divided by their max-abs
    (float64 gradients, or a device without float64: else a square could overflow)."""
    wide = any(_dtypes.name_of(g) == "float64" for g in arrays)
    if not wide and _dtypes.computes_float64(xp, array_api_compat.device(arrays[0])):
        return "float64", False
    return ("float64" if wide else "float32"), True


def _zero(xp: Any, acc: str, like: Any) -> Any:
    return xp.zeros((), dtype=_dtypes.resolve(xp, acc), device=array_api_compat.device(like))


def _sum_of_squares(xp: Any, arrays: Sequence[Any], acc: str, inv: Any = None) -> Any:
    """sum((g * inv)**2) over all arrays, each chunk cast to ``acc`` first: a fixed number of passes."""
    parts = []
    for grad in arrays:
        flat = xp.reshape(grad, (-1,))
        size = flat.shape[0]
        for start in range(0, size, _CHUNK):
            chunk = _dtypes.cast(flat[start:min(start + _CHUNK, size)], acc)
            if inv is not None:
                chunk = chunk * inv
            parts.append(xp.vecdot(chunk, chunk))
    if not parts:
        return _zero(xp, acc, arrays[0])
    return parts[0] if len(parts) == 1 else xp.sum(xp.stack(parts))


def global_norm(grads: Any, *, scaler: Any = None) -> Any:
    """The L2 norm of all gradients together, a 0-d array: finite whenever every value is finite.

    Squares are summed in float64 (float64 gradients, or devices without it, are divided by their
    max-abs first); inf/nan when any value is. No host synchronisation. With a distributed
    ``scaler`` the norm spans every rank, in the scaler's one collective (``agree_``).
    """
    arrays = _arrays(grads, scaler, "global_norm")
    engine = _distributed_engine(scaler)
    if engine is None:
        return _local_norm(_namespace(arrays, "global_norm"), arrays)
    return _agreed_norm(engine, arrays, "global_norm")


def _local_norm(xp: Any, arrays: Sequence[Any]) -> Any:
    """The L2 norm of this rank's ``arrays`` (see :func:`global_norm`)."""
    acc, rescale = _accumulator(xp, arrays)
    if not rescale:
        return xp.sqrt(_sum_of_squares(xp, arrays, acc))
    # max |value|, 0-d in ``acc`` (nan or inf when any value is); no copies
    peaks = [_dtypes.cast(xp.maximum(xp.max(g), -xp.min(g)), acc) for g in arrays if math.prod(g.shape)]
    peak = xp.max(xp.stack(peaks)) if peaks else _zero(xp, acc, arrays[0])
    ok = xp.isfinite(peak)
    tiny = xp.full_like(peak, xp.finfo(peak.dtype).smallest_normal)
    peak = xp.maximum(peak, tiny)  # so 1 / peak is finite
    # inf/nan values: any finite factor keeps the sum inf/nan; tiny keeps finite squares finite
    root = xp.sqrt(_sum_of_squares(xp, arrays, acc, xp.where(ok, xp.ones_like(peak) / peak, tiny)))
    return xp.where(ok, peak * root, root)


def squared_norm(arrays: Sequence[Any]) -> Any:
    """The square of :func:`global_norm`'s local norm over ``arrays`` (one library, at least one)."""
    xp = _namespace(arrays, "StepGuard's gradient norm")
    acc, rescale = _accumulator(xp, arrays)
    if not rescale:
        return _sum_of_squares(xp, arrays, acc)
    norm = _local_norm(xp, arrays)
    return norm * norm


def _agreed_norm(engine: Any, arrays: Sequence[Any], what: str) -> Any:
    """The L2 norm over every rank's gradients: this rank's sum of squares s rides in the engine's
    collective as (s, s / h**2), h = 2**512 (float32: 2**64); the second holds a total past the max."""
    if arrays:
        xp = _namespace(arrays, what)
        acc, rescale = _accumulator(xp, arrays)
        if rescale:  # s may overflow where its root does not: square the local norm both ways
            norm = _local_norm(xp, arrays)
            h = _half_range(xp, norm.dtype)
            fits = xp.where(norm < h / 2, norm, xp.full_like(norm, math.inf))  # inf: no overflow warning
            pair = xp.stack([fits * fits, (norm / h) * (norm / h)])
        else:
            sum_sq = _sum_of_squares(xp, arrays, acc)
            h = _half_range(xp, sum_sq.dtype)
            pair = xp.stack([sum_sq, sum_sq / h / h])
    else:  # no gradients here: send zeros in float64 (as ranks with gradients do), where the state is
        like = engine.state.scale  # unscale_ ran (checked), so the state exists
        xp = _namespace([like], what)
        pair = xp.stack([_zero(xp, "float64", like)] * 2)
    total = engine.agree_(pair).extra
    h = _half_range(xp, total.dtype)
    return xp.where(xp.isfinite(total[0]), xp.sqrt(total[0]), xp.sqrt(total[1]) * h)


def _half_range(xp: Any, dtype: Any) -> float:
    """2**k with 2**(2k) about the dtype's max: 2**512 for float64, 2**64 for float32."""
    return 2.0 ** (math.frexp(float(xp.finfo(dtype).max))[1] // 2)


def _check_max_norm(max_norm: Any) -> float:
    if isinstance(max_norm, bool) or not isinstance(max_norm, numbers.Real) or not max_norm > 0:
        raise ConfigError("max_norm must be a number > 0 (math.inf disables clipping), "
                          f"got max_norm={max_norm!r}; pass e.g. max_norm=1.0")
    return float(max_norm)


def clip_grad_norm_(grads: Any, max_norm: float, *, scaler: Any = None, eps: float = 1e-6) -> Any:
    """Scale gradients in place so their global norm is at most ``max_norm``; return the pre-clip norm.

    A non-finite norm leaves the gradients untouched (the scaler skips that step). No host
    synchronisation; with a distributed ``scaler`` the norm is global (see :func:`global_norm`).
    """
    max_norm = _check_max_norm(max_norm)
    arrays = _arrays(grads, scaler, "clip_grad_norm_")
    _check_writable(arrays)  # before the norm: a half-clipped list must not be left behind
    engine = _distributed_engine(scaler)
    if engine is not None and not arrays:  # a rank without gradients still takes part
        return _agreed_norm(engine, arrays, "clip_grad_norm_")
    xp = _namespace(arrays, "clip_grad_norm_")
    norm = _local_norm(xp, arrays) if engine is None else _agreed_norm(engine, arrays, "clip_grad_norm_")
    coef = max_norm / (norm + eps)
    keep = ~xp.isfinite(norm) | (coef >= 1.0)
    coef = xp.where(keep, xp.ones_like(coef), coef)
    for grad in arrays:
        grad *= xp.astype(coef, grad.dtype)
    return norm


def _check_writable(arrays: Sequence[Any]) -> None:
    """Refuse read-only arrays (NumPy's ``flags.writeable``): clipping writes every gradient in place."""
    for grad in arrays:
        if not getattr(getattr(grad, "flags", None), "writeable", True):
            raise ValueError("clip_grad_norm_ scales gradients in place, but got a "
                             f"read-only array ({_inputs.describe(grad)}, flags.writeable "
                             "is False); nothing was changed. Fix: pass writable gradients "
                             "(np.array(g) is a writable copy), or clip with global_norm().")


class GradBuffer(FlatArrays):
    """Gradients as views of one flat array: zero, scale, norm and clip are one call each, however
    many tensors; ``flat`` goes to ``LossScaler.unscale_`` as a single gradient."""

    _params: Sequence[Any] = ()  # whose ``.grad`` the views are (:meth:`attach`)
    _scaled = False

    @classmethod
    def attach(cls, params: Iterable[Any], *, spare: int = 0) -> GradBuffer:
        """A buffer for ``params`` (polyamp.Parameters or torch tensors) that becomes their ``.grad``
        (existing gradients copied in); ``spare`` as in :class:`polyamp.flat.FlatArrays`."""
        params = _inputs.iterable(params, "GradBuffer.attach", "params", "list(model.parameters())",
                                  "parameters", "[param]")
        if not params:
            raise ConfigError("GradBuffer.attach got no parameters; pass a non-empty list")
        _check_parameters(params)
        datas = [getattr(p, "data", p) for p in params]
        names = {_dtypes.name_of(d) for d in datas}
        if len(names) != 1 or None in names:
            raise ConfigError("GradBuffer.attach needs parameters of one floating dtype, got dtypes "
                              f"{sorted(str(d.dtype) for d in datas)}; make one buffer per dtype")
        buffer = cls([tuple(d.shape) for d in datas], names.pop(), like=datas[0], spare=spare)
        buffer._params = params
        buffer.reattach()
        return buffer

    def reattach(self) -> None:
        """Point every parameter's ``.grad`` back at its view (after e.g. ``zero_grad(set_to_none=True)``)."""
        for param, view in zip(self._params, self.views):
            grad = param.grad
            if grad is view:
                continue
            if grad is not None:
                view[...] = grad
            param.grad = view

    # -- what it holds ------------------------------------------------------------------
    @property
    def scaled(self) -> bool:
        """Whether the gradients are still multiplied by the loss scale (see :meth:`mark_scaled`)."""
        return self._scaled

    def __repr__(self) -> str:
        return f"{super().__repr__()[:-1]}, scaled={self._scaled})"

    # -- one call each --------------------------------------------------------------------
    def zero_(self) -> None:
        """Set every gradient to zero: one fill of ``flat`` (and no longer scaled)."""
        super().zero_()
        self._scaled = False

    def mark_scaled(self) -> None:
        """Record that a backward pass of a scaled loss wrote the gradients (norms now refuse them)."""
        self._scaled = True

    def unscale_(self, scaler: Any, *, names: Sequence[str] | None = None) -> Any:
        """Unscale through ``scaler.unscale_`` in one call on ``flat``; return its overflow flag.

        ``names`` (one per view): the views instead, as a dict keyed by them (the same values, still one
        call), so that a precision meter's report names each gradient."""
        found_inf = scaler.unscale_([self.flat] if names is None else dict(zip(names, self.views)))
        self._scaled = False
        return found_inf

    def norm(self, *, scaler: Any = None) -> Any:
        """The global L2 norm of the unscaled gradients (0-d array, see :func:`global_norm`)."""
        return global_norm(self, scaler=scaler)

    def clip_(self, max_norm: float, eps: float = 1e-6, *, scaler: Any = None) -> Any:
        """Clip by global norm in place (see :func:`clip_grad_norm_`); return the pre-clip norm."""
        return clip_grad_norm_(self, max_norm, scaler=scaler, eps=eps)


def _check_parameters(params: Sequence[Any]) -> None:
    """Refuse what cannot take a ``.grad`` view: only parameters with an array in ``.data`` can."""
    for i, param in enumerate(params):
        data = getattr(param, "data", None)
        if not hasattr(param, "grad") or not array_api_compat.is_array_api_obj(data):
            raise TypeError("GradBuffer.attach needs parameters with an array in .data and a settable "
                            f".grad (polyamp.Parameter, torch tensors), got params[{i}] of type "
                            f"{type(param).__module__}.{type(param).__name__}. Fix: wrap arrays as "
                            "polyamp.Parameter(array), or build GradBuffer(shapes, dtype) for bare arrays.")
