"""Gradient utilities over any array library: global L2 norm, clip by global norm, and a
contiguous gradient buffer whose every gradient is a view of one flat array.

Array-API code through array-api-compat: no Python loop over elements and no host
synchronisation (norms are 0-d arrays on the gradients' device). Norms and clipping refuse
gradients that are still multiplied by the loss scale; they learn that from a
:class:`GradBuffer` (``scaled``) or from the scaler passed as ``scaler=``.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Sequence
from typing import Any

import array_api_compat

from . import _dtypes
from ._errors import ConfigError
from .engine import ScalerStateError
from .flat import FlatArrays

__all__ = ["GradBuffer", "ScaledGradientsError", "clip_grad_norm_", "global_norm"]


class ScaledGradientsError(ScalerStateError):
    """Gradients are still multiplied by the loss scale; unscale them before norms or clipping."""


def _check_unscaled(scaler: Any, what: str) -> None:
    """Raise ScaledGradientsError when ``scaler`` has not unscaled this iteration's gradients."""
    if scaler is None:
        return
    is_enabled = getattr(scaler, "is_enabled", None)  # the torch-style facade
    if callable(is_enabled) and not is_enabled():
        return
    engine = getattr(scaler, "engine", scaler)
    if getattr(engine, "enabled", True) and not getattr(engine, "has_pending_check", False):
        raise ScaledGradientsError(
            f"{what} got gradients still multiplied by the loss scale: scaler={type(scaler).__name__} "
            "has not unscaled them this iteration, so the norm would be ~scale times too big. "
            "Fix: call scaler.unscale_(grads) (or buffer.unscale_(scaler)) first."
        )


def _arrays(grads: Any, scaler: Any, what: str) -> list[Any]:
    """The arrays to work on (one flat array for a GradBuffer), after the still-scaled checks."""
    if isinstance(grads, GradBuffer):
        if grads.scaled:
            raise ScaledGradientsError(
                f"{what} got a GradBuffer still multiplied by the loss scale (buffer.scaled is "
                "True). Fix: call buffer.unscale_(scaler) first."
            )
        arrays = [grads.flat]
    elif array_api_compat.is_array_api_obj(grads):
        arrays = [grads]
    else:
        arrays = [g for g in grads if g is not None]
    _check_unscaled(scaler, what)
    if not arrays:
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


def _sum_of_squares(xp: Any, grad: Any) -> Any:
    """Sum of squares of one gradient, accumulated in float32 (float64 stays float64)."""
    flat = xp.reshape(grad, (-1,))
    if _dtypes.name_of(flat) in ("float16", "bfloat16"):
        flat = xp.astype(flat, xp.float32)
    return xp.vecdot(flat, flat)


def global_norm(grads: Any, *, scaler: Any = None) -> Any:
    """The L2 norm of all gradients together, a 0-d array (inf/nan when any value is).

    One dot product per array, one in all for a GradBuffer; no host synchronisation.
    """
    arrays = _arrays(grads, scaler, "global_norm")
    xp = _namespace(arrays, "global_norm")
    squares = [_sum_of_squares(xp, g) for g in arrays]
    total = squares[0] if len(squares) == 1 else xp.sum(xp.stack(squares))
    return xp.sqrt(total)


def _check_max_norm(max_norm: Any) -> float:
    if isinstance(max_norm, bool) or not isinstance(max_norm, numbers.Real) or not max_norm > 0:
        raise ConfigError(
            f"max_norm must be a number > 0 (math.inf disables clipping), got max_norm={max_norm!r}; "
            "pass e.g. max_norm=1.0"
        )
    return float(max_norm)


def clip_grad_norm_(grads: Any, max_norm: float, *, scaler: Any = None, eps: float = 1e-6) -> Any:
    """Scale gradients in place so their global norm is at most ``max_norm``; return the pre-clip norm.

    A non-finite norm leaves the gradients untouched and is returned as is (the scaler skips
    that step). One read and one write pass per array, no host synchronisation.
    """
    max_norm = _check_max_norm(max_norm)
    arrays = _arrays(grads, scaler, "clip_grad_norm_")
    xp = _namespace(arrays, "clip_grad_norm_")
    norm = global_norm(arrays)
    coef = max_norm / (norm + eps)
    keep = ~xp.isfinite(norm) | (coef >= 1.0)
    coef = xp.where(keep, xp.ones_like(coef), coef)
    for grad in arrays:
        grad *= xp.astype(coef, grad.dtype)
    return norm


class GradBuffer(FlatArrays):
    """Gradients as views of one flat array: zero, scale, norm and clip are one call each.

    Per-step cost stops growing with the number of parameter tensors, and ``flat`` can be
    handed to ``LossScaler.unscale_`` as a single gradient. Backward passes overwrite the views.
    """

    def __init__(self, shapes: Iterable[Sequence[int]], dtype: Any = "float32", *, like: Any = None) -> None:
        super().__init__(shapes, dtype, like=like)
        self._params: list[Any] = []
        self._scaled = False

    @classmethod
    def attach(cls, params: Iterable[Any]) -> GradBuffer:
        """A buffer for ``params`` (polyamp.Parameters or torch tensors) that becomes their ``.grad``.

        Existing gradients are copied in; afterwards ``p.grad`` is a view of ``flat`` for every p.
        """
        params = list(params)
        if not params:
            raise ConfigError("GradBuffer.attach got no parameters; pass a non-empty list")
        datas = [getattr(p, "data", p) for p in params]
        names = {_dtypes.name_of(d) for d in datas}
        if len(names) != 1 or None in names:
            raise ConfigError(
                f"GradBuffer.attach needs parameters of one floating dtype, got dtypes "
                f"{sorted(str(d.dtype) for d in datas)}; make one buffer per dtype"
            )
        buffer = cls([tuple(d.shape) for d in datas], names.pop(), like=datas[0])
        buffer._params = params
        buffer.reattach()
        return buffer

    def reattach(self) -> None:
        """Point every attached parameter's ``.grad`` back at its view (copying a stray gradient in).

        Needed after code that replaces ``.grad`` (e.g. an optimizer's zero_grad(set_to_none=True)).
        """
        for param, view in zip(self._params, self._views):
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

    def unscale_(self, scaler: Any) -> Any:
        """Unscale through ``scaler.unscale_`` in one call on ``flat``; return its overflow flag."""
        found_inf = scaler.unscale_([self._flat])
        self._scaled = False
        return found_inf

    def norm(self) -> Any:
        """The global L2 norm of the unscaled gradients (0-d array): one dot product."""
        return global_norm(self)

    def clip_(self, max_norm: float, eps: float = 1e-6) -> Any:
        """Clip by global norm in place (see :func:`clip_grad_norm_`); return the pre-clip norm."""
        return clip_grad_norm_(self, max_norm, eps=eps)
