"""NumPy unscale, check and precision counts in ONE pass over each gradient (a meter's sample step).

The counts are :mod:`polyamp._precision_counts`'s, bit for bit, without float64 arithmetic per value:
``v = |g| * s`` rounded in float64 is monotonic in ``|g|``, so each test ``v <= t`` (or ``v < t``)
holds exactly up to one bit pattern of the dtype, found once per (dtype, s, t) by bisection on the
host; the kernel compares each value's ``bits & ~sign`` with those patterns. Per cache-sized block:
``_numpy_kernels``' compiled unscale, then the counts while the block is in cache. An ``"amax"``
target's counts take a second, read-only pass (its scale needs the amax). numba only; a gradient
the kernel cannot take is unscaled and counted by the unfused passes. Imports only NumPy.
"""

from __future__ import annotations

import functools
import math
import struct
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from polyamp._precision_counts import _target_scale

from . import _numpy_kernels as k

#: Values per block: the unscale and the counts of a block share one trip through memory.
BLOCK = 16384

# per dtype name: (bits dtype, |bits| mask, the bits of +inf, largest finite bits). Signed: |bits|
# is never negative, and numba mixing unsigned with signed integers would compare in float64.
_BITS = {
    "float32": (np.int32, 0x7FFFFFFF, 0x7F800000, 0x7F7FFFFF),
    "float64": (np.int64, 0x7FFFFFFFFFFFFFFF, 0x7FF0000000000000, 0x7FEFFFFFFFFFFFFF),
    "float16": (np.int16, 0x7FFF, 0x7C00, 0x7BFF),
    "bfloat16": (np.int16, 0x7FFF, 0x7F80, 0x7F7F),
}


def value(bits: int, name: str) -> float:
    """The float a non-negative bit pattern of dtype ``name`` stands for (exactly, as a Python float)."""
    if name == "float64":
        return struct.unpack("<d", struct.pack("<Q", bits))[0]
    if name == "float16":
        return struct.unpack("<e", struct.pack("<H", bits))[0]
    return struct.unpack("<f", struct.pack("<I", bits << 16 if name == "bfloat16" else bits))[0]


@functools.lru_cache(maxsize=4096)  # a scale that keeps changing: the oldest go
def limit(name: str, s: float, t: float, strict: bool) -> int:
    """The largest finite non-negative bits ``b`` of dtype ``name`` with ``value(b) * s <= t`` (``< t``
    when ``strict``), the product rounded in float64; 0 passes always (``t > 0``). Remembered."""

    def passes(b: int) -> bool:
        v = value(b, name) * s
        return v < t if strict else v <= t

    lo, hi = 0, _BITS[name][3]
    if passes(hi):
        lo = hi
    while hi - lo > 1:  # passes(lo), not passes(hi)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if passes(mid) else (lo, mid)
    return lo


# ----------------------------------------------------------------------------- compiled kernels
def _counts(bits: Any, absmask: Any, inf: Any, limits: Any, out: Any, ext: Any) -> None:  # numba
    """Add one block's counts to ``out``: zeros, non-finite, then per limit #(|bits| <= limit); keep
    in ``ext`` the largest finite |bits| and the smallest non-zero finite |bits| (``inf``: none).
    Only a limit inside the block's range of finite non-zero values is compared value by value."""
    zeros = nonfinite = np.int32(0)  # a block's counts fit (BLOCK < 2**31)
    top, low = absmask & 0, absmask
    for i in range(bits.size):  # the usual block: no zero, no inf or nan, two reductions tell
        b = bits[i] & absmask
        top = max(top, b)
        low = min(low, b)
    if low == 0 or top >= inf:
        top, low = absmask & 0, inf
        for i in range(bits.size):
            b = bits[i] & absmask
            zeros += np.int32(b == 0)
            nonfinite += np.int32(b >= inf)
            finite = b < inf
            top = max(top, b if finite else absmask & 0)
            low = min(low, b if finite and b != 0 else inf)
    out[0] += zeros
    out[1] += nonfinite
    ext[0], ext[1] = max(ext[0], top), min(ext[1], low)
    for j in range(limits.size):
        t = limits[j]
        if top <= t:
            out[2 + j] += bits.size - nonfinite
        elif low > t:
            out[2 + j] += zeros
        else:
            c = np.int32(0)
            for i in range(bits.size):
                c += np.int32((bits[i] & absmask) <= t)
            out[2 + j] += c


def _le(bits: Any, absmask: Any, limits: Any, out: Any) -> None:  # numba
    """``out[2 + j] += #(|bits| <= limits[j])``, one vectorised loop per limit."""
    for j in range(limits.size):
        t = limits[j]
        c = 0
        for i in range(bits.size):
            c += (bits[i] & absmask) <= t
        out[2 + j] += c


def _fused_source(check: Any, counts: Any) -> Callable[..., bool]:
    """One gradient's fused kernel: per block, ``check`` (a ``_numpy_kernels`` dispatcher) unscales
    it, then ``counts`` counts it in cache; True if an input value was inf/nan."""

    def fused(g: Any, bits: Any, inv: Any, absmask: Any, inf: Any, limits: Any, out: Any, ext: Any,
              block: int) -> bool:
        bad = False
        for start in range(0, g.size, block):
            stop = min(g.size, start + block)
            bad |= check(g[start:stop], inv, True)
            counts(bits[start:stop], absmask, inf, limits, out, ext)
        return bad

    return fused


@functools.cache
def _load() -> tuple[dict[str, Callable[..., bool]], Callable[..., None]] | None:
    """The fused kernels by dtype name and the compiled :func:`_le`, once per process; None without numba."""
    if k._load_compiled() is None:
        return None
    try:
        import numba

        counts = numba.njit(nogil=True, cache=True)(_counts)
        fused = {name: numba.njit(nogil=True)(_fused_source(check, counts))
                 for name, check in k.dispatchers.items()}
        return fused, numba.njit(nogil=True, cache=True)(_le)
    except Exception:  # noqa: BLE001 - numba cannot compile here: the unfused passes
        return None


def fused_available() -> bool:
    """Whether the compiled fused kernels run here (numba, and the compiled NumPy kernels requested)."""
    return k._requested() == "compiled" and _load() is not None


# ----------------------------------------------------------------------------- one gradient
class _Plan:
    """One step's targets: the limits of the targets with a known scale, and where the "amax" ones sit."""

    def __init__(self, bounds: Sequence[Any], scale: float | None) -> None:
        self.bounds = tuple(bounds)
        self.known = [j for j, b in enumerate(bounds) if b.scale != "amax"]
        self.amax = [j for j, b in enumerate(bounds) if b.scale == "amax"]
        self.scales = {j: scale if bounds[j].scale == "loss" else float(bounds[j].scale) for j in self.known}
        self.known_limits: dict[str, np.ndarray] = {}  # per dtype name: the known targets' limits

    def of_known(self, name: str) -> np.ndarray:
        """:meth:`limits` of the targets with a known scale, once per dtype."""
        if name not in self.known_limits:
            self.known_limits[name] = self.limits(name, self.known, self.scales)
        return self.known_limits[name]

    def limits(self, name: str, targets: Sequence[int], scales: dict[int, float]) -> np.ndarray:
        """Per target of ``targets``: its three limits (underflow, subnormal, not overflow), as bits."""
        found = []
        for j in targets:
            b, s = self.bounds[j], scales[j]
            found += [limit(name, s, b.underflow_max, False), limit(name, s, b.subnormal_below, True),
                      limit(name, s, b.overflow_from, True)]
        return np.asarray(found, _BITS[name][0])


def _one(g: np.ndarray, inv: np.float32, plan: _Plan, workers: int) -> tuple[bool, list[int], float, float]:
    """Unscale, check and count one flat, writable, contiguous gradient: (bad, its counts in the
    layout's order, amax, -amin)."""
    name = k._name(g.dtype)
    kind, absmask, inf, _ = _BITS[name]
    bits = g.view(kind)
    data = g.view(np.uint16) if name in ("float16", "bfloat16") else g
    scalar = np.float64(inv) if name == "float64" else inv
    limits = plan.of_known(name)
    kernels, count_le = _load()
    fused = kernels[name]
    mask, infinity = kind(absmask), kind(inf)
    parts = min(workers, g.nbytes // k.PARALLEL_BYTES)
    step = max(1, g.size if parts < 2 else -(-g.size // parts // 64) * 64)
    spans = [(i, min(g.size, i + step)) for i in range(0, g.size, step)] or [(0, 0)]
    outs = [np.zeros(2 + limits.size, np.int64) for _ in spans]
    exts = [np.asarray([0, inf], kind) for _ in spans]

    def run(i: int) -> bool:
        a, b = spans[i]
        with np.errstate(all="ignore"):
            return bool(fused(data[a:b], bits[a:b], scalar, mask, infinity, limits, outs[i], exts[i], BLOCK))

    bad = any(k.on_threads(run, len(spans), workers))
    out = outs[0] if len(outs) == 1 else np.sum(outs, axis=0)
    top, low = max(int(e[0]) for e in exts), min(int(e[1]) for e in exts)
    amax, neg_amin = value(top, name), (-value(low, name) if low != inf else -math.inf)
    le = {j: out[2 + 3 * i:5 + 3 * i].tolist() for i, j in enumerate(plan.known)}
    if plan.amax:  # their scale needs the amax: a second, read-only pass
        scales = {j: float(_target_scale(np, plan.bounds[j], None, np.float64(amax), None))
                  for j in plan.amax}  # as the unfused count makes them
        extra = np.zeros(2 + 3 * len(plan.amax), np.int64)
        count_le(bits, mask, plan.limits(name, plan.amax, scales), extra)
        le.update({j: extra[2 + 3 * i:5 + 3 * i].tolist() for i, j in enumerate(plan.amax)})
    numel, zeros, nonfinite = g.size, int(out[0]), int(out[1])
    row = [numel, zeros, nonfinite]
    for j in range(len(plan.bounds)):
        under, sub, kept = le[j]
        row += [under - zeros, sub - under, numel - kept - nonfinite]
    return bad, row, amax, neg_amin


def _flat(g: np.ndarray) -> np.ndarray | None:
    """A flat view the fused kernel takes: C-contiguous, aligned, native, writable, of a compiled dtype."""
    takes = g.flags.c_contiguous and g.flags.aligned and g.flags.writeable and g.dtype.isnative
    return g.reshape(-1) if takes and k._name(g.dtype) in _load()[0] else None


def unscale_and_count(grads: Sequence[np.ndarray], inv: np.float32, scale: float | None,
                      found_inf: np.ndarray, bounds: Sequence[Any]) -> tuple[np.ndarray, np.ndarray]:
    """``_numpy_kernels.unscale_and_check_`` and ``_precision_counts.count`` of the results (``scale``:
    the loss scale as a float, for "loss" targets), fused per gradient where the kernel takes it.
    ``(counts int64, extremes float64)`` as the count lays them out."""
    k.check_writable(grads, not inv == 1.0)
    fused = fused_available() and inv == inv
    plan, workers = _Plan(bounds, scale), k.threads()
    rows = []  # per gradient: (bad, counts, amax, -amin)
    for g in grads:
        flat = _flat(g) if fused else None
        rows.append(_one(flat, inv, plan, workers) if flat is not None else _unfused(g, inv, scale, bounds))
    if any(row[0] for row in rows):
        found_inf[...] = 1.0
    counts = [c for row in rows for c in row[1]]
    return np.asarray(counts, np.int64), np.asarray([r[2] for r in rows] + [r[3] for r in rows], np.float64)


def _unfused(g: np.ndarray, inv: np.float32, scale: float | None,
             bounds: Sequence[Any]) -> tuple[bool, list[int], float, float]:
    """:func:`_one`'s result by the unfused passes on this gradient alone: unscale, then count."""
    import array_api_compat.numpy as xp

    from polyamp import _precision_counts as precision

    flag = np.zeros((), np.float32)
    k.unscale_and_check_([g], np.asarray(inv), flag)
    one = precision.count(xp, [g], scale if scale is not None else 1.0, bounds,
                          precision.Kinds(xp.float64, xp.int64, "cpu"))
    return bool(flag), one.counts.tolist(), float(one.extremes[0]), float(one.extremes[1])

