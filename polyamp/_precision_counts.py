"""Exact precision counts over any library's arrays: the one algorithm every backend runs.

Per gradient ``g`` (computed in float64; a device without float64 is refused), with ``a = |g|``
over the finite values (0 elsewhere) and, per target, ``v = a * s``::

    numel, nonfinite = #(not isfinite(g)), zeros = #(g == 0) = numel - nonfinite - #(a > 0)
    amax = max(a), amin = min(a over a > 0)
    underflow = #(v <= m/2) - zeros - nonfinite     (0 < |v| <= m/2: the cast gives 0)
    subnormal = #(v < n - m/2) - #(v <= m/2)         (m/2 < |v| < n - m/2)
    overflow  = #(v >= M + ulp(M)/2)                 (not representable)

Vectorised passes only, no host read, no change to ``grads``. The result is two flat arrays a step
can send as they are: ``counts`` (int64, summed over ranks) and ``extremes`` (float64, max over
ranks: every amax, then every ``-amin``, ``-inf`` where a gradient has no non-zero finite value).
:class:`Layout` says where each value sits.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

from ._errors import ConfigError
from ._precision_targets import Bounds

FLOAT64_MAX = 1.7976931348623157e308

#: The counts of one gradient, in order, before its targets' counts.
FIELDS = ("numel", "zeros", "nonfinite")
#: The counts of one gradient for one target, in order.
TARGET_FIELDS = ("underflow", "subnormal", "overflow")


class Measured(NamedTuple):
    """The counts of one measurement, on the gradients' device: ``counts`` (int64, summed over ranks)
    and ``extremes`` (float64, max over ranks). A NamedTuple, so a pytree under ``jax.jit``."""

    counts: Any
    extremes: Any


class Row(NamedTuple):
    """One gradient's values read back from the arrays: its counts in :data:`FIELDS` order, per
    target its :data:`TARGET_FIELDS` counts, its amax and its amin (None: no non-zero finite value)."""

    counts: tuple[int, ...]
    targets: tuple[tuple[int, ...], ...]
    amax: float
    amin: float | None


class Layout(NamedTuple):
    """Where each value of ``counts`` and ``extremes`` sits, for ``tensors`` gradients and ``targets``
    targets: gradient i's counts at ``[i * per_tensor, (i + 1) * per_tensor)``."""

    tensors: int
    targets: int

    @property
    def per_tensor(self) -> int:
        return len(FIELDS) + len(TARGET_FIELDS) * self.targets

    @property
    def sizes(self) -> tuple[int, int]:
        """The lengths of ``counts`` and ``extremes``."""
        return self.tensors * self.per_tensor, 2 * self.tensors

    def rows(self, counts: Sequence[int], extremes: Sequence[float]) -> list[Row]:
        """Each gradient's :class:`Row` from host ``counts`` and ``extremes`` (summed and max-reduced
        over ranks, or one rank's)."""
        rows, k, n = [], len(TARGET_FIELDS), self.tensors
        for i in range(n):
            part = [int(c) for c in counts[i * self.per_tensor:(i + 1) * self.per_tensor]]
            head, rest = part[:len(FIELDS)], part[len(FIELDS):]
            neg_amin = float(extremes[n + i])
            rows.append(Row(tuple(head), tuple(tuple(rest[j * k:(j + 1) * k]) for j in range(self.targets)),
                            float(extremes[i]), None if neg_amin == -math.inf else -neg_amin))
        return rows


class Kinds(NamedTuple):
    """The dtypes and device the counts are made in: the library's float64 and int64 (by object or
    name) and the gradients' device."""

    floats: Any
    ints: Any
    device: Any


def count(xp: Any, grads: Sequence[Any], scale: Any, bounds: Sequence[Bounds], kinds: Kinds) -> Measured:
    """``Measured(counts, extremes)`` of ``grads`` (non-empty, on one device) for each target's ``bounds``;
    ``xp``: their namespace (astype, reshape, abs, isfinite, where, zeros_like, full_like, count_nonzero,
    max, min, stack, asarray); ``scale``: the loss scale, a 0-d array on their device or a number."""
    if any(b.scale == "loss" for b in bounds):
        scale = xp.astype(scale, kinds.floats) if hasattr(scale, "shape") else float(scale)
    parts, amaxes, neg_amins = zip(*(_one(xp, g, scale, bounds, kinds) for g in grads))
    return Measured(xp.stack([c for p in parts for c in p]), xp.stack([*amaxes, *neg_amins]))


def _one(xp: Any, g: Any, scale: Any, bounds: Sequence[Bounds], kinds: Kinds) -> tuple[list[Any], Any, Any]:
    """One gradient's counts (0-d ``kinds.ints``), its amax and its -amin (0-d ``kinds.floats``)."""
    numel = math.prod(g.shape)

    def const(value: Any, dtype: Any) -> Any:
        return xp.asarray(value, dtype=dtype, device=kinds.device)

    if numel == 0:
        return [const(0, kinds.ints)] * (len(FIELDS) + len(TARGET_FIELDS) * len(bounds)), \
            const(0.0, kinds.floats), const(-math.inf, kinds.floats)

    def number(mask: Any) -> Any:
        return xp.astype(xp.count_nonzero(mask), kinds.ints)

    wide = xp.astype(xp.reshape(g, (-1,)), kinds.floats)
    finite = xp.isfinite(wide)
    a = xp.where(finite, xp.abs(wide), xp.zeros_like(wide))
    nonfinite = const(numel, kinds.ints) - number(finite)
    zeros = const(numel, kinds.ints) - nonfinite - number(a > 0)  # no ==: paddle's float == is approximate
    amax = xp.max(a)
    neg_amin = -xp.min(xp.where(a > 0, a, xp.full_like(a, math.inf)))
    parts = [const(numel, kinds.ints), zeros, nonfinite]
    for b in bounds:
        v = a * _target_scale(xp, b, scale, amax, kinds)
        low = number(v <= b.underflow_max)
        parts += [low - zeros - nonfinite, number(v < b.subnormal_below) - low, number(v >= b.overflow_from)]
    return parts, amax, neg_amin


def _target_scale(xp: Any, bound: Bounds, scale: Any, amax: Any, kinds: Kinds) -> Any:
    """The multiplier of one target: the loss scale, the number, or ``M / amax`` (1 when amax is 0;
    the largest finite float where that quotient overflows)."""
    if bound.scale == "loss":
        return scale
    if bound.scale != "amax":
        return float(bound.scale)
    s = bound.max_finite / xp.where(amax > 0, amax, xp.full_like(amax, bound.max_finite))
    return xp.where(xp.isfinite(s), s, xp.full_like(s, FLOAT64_MAX))


def array_api_kinds(xp: Any, device: Any) -> Kinds:
    """:class:`Kinds` for namespace ``xp`` on ``device``; ConfigError where the device has no float64
    (JAX without ``jax_enable_x64``, asked each call as it may change; Apple MPS): float32 cannot
    hold bfloat16's thresholds as normal numbers, and XLA flushes float32 subnormals to 0."""
    try:
        info = xp.__array_namespace_info__()
        floats = info.dtypes(device=device, kind="real floating")
        ints = info.dtypes(device=device, kind="signed integer")
    except (AttributeError, TypeError, ValueError):  # no inspection API, or an odd device
        floats, ints = {"float64": None}, {"int64": None}
    if "float64" not in floats or "int64" not in ints or getattr(device, "type", None) == "mps":
        raise ConfigError(
            f"precision counts are exact in float64 and int64, which {getattr(xp, '__name__', xp)} does not "
            f"compute on device {device} here. Fix: with JAX, jax.config.update('jax_enable_x64', True) "
            "first; on Apple MPS, measure copies of the gradients on the CPU."
        )
    return Kinds(xp.float64, xp.int64, device)
