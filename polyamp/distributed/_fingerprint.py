"""What every rank must hold equal, written as bits that the step's one SUM all-reduce checks.

An agreement message is ``[non-finite count, extra0, extra1, *bits]`` (float64, the same length on
every rank and call). ``bits`` are the 32 bits of each field in :data:`FIELDS`, one value 0/1 per
element. Summed over n ranks, a bit is 0 or n exactly when every rank sent the same bit (sums of
0/1 values are exact in float32 up to 2**24 ranks, in float64 up to 2**53), so misalignment is
found inside the collective that agrees the flag, at no extra collective. A field's value on the
other ranks is read back from the sums where they agree among themselves (always with 2 ranks).
"""

from __future__ import annotations

import math
import struct
from typing import Any, NamedTuple

import numpy as np

#: The fields of a fingerprint, in message order (32 bits each).
FIELDS = ("config", "iteration", "collective", "sequence", "payload", "scale", "growth_tracker",
          "backoff_tracker")
WIDTH = 32
BITS = len(FIELDS) * WIDTH
#: Elements before the bits: the non-finite count and two extra values (e.g. a sum of squares pair).
HEAD = 3
MESSAGE = HEAD + BITS
_MASK = 2**WIDTH - 1
_F32, _U32 = struct.Struct("<f"), struct.Struct("<I")


class Fingerprint(NamedTuple):
    """One rank's fingerprint as host integers (the scale as its float32 bit pattern)."""

    config: int
    iteration: int
    collective: int
    sequence: int
    payload: int
    scale: int
    growth_tracker: int
    backoff_tracker: int


def scale_bits(scale: float) -> int:
    """The float32 bit pattern of ``scale`` (what a device computes from the scale array)."""
    return _U32.unpack(_F32.pack(scale))[0]


def host_bits(values: Fingerprint | list[int]) -> np.ndarray:
    """The fingerprint as ``BITS`` uint8 values of 0 and 1 (field by field, least bit first)."""
    words = np.array([v & _MASK for v in values], dtype="<u4")
    return np.unpackbits(words.view(np.uint8), bitorder="little")


class DeviceBits:
    """Computes the bits on the state's device, without a host read (for GPU arrays).

    Host fields enter as fills (kernel arguments, no host-to-device copy); the scale's bit
    pattern is rebuilt exactly from comparisons with the powers of two (no bit cast needed).
    """

    def __init__(self, xp: Any, device: Any) -> None:
        self.xp, self.device = xp, device
        f64 = xp.float64
        self._powers = xp.asarray(np.ldexp(1.0, np.arange(-126, 128)), dtype=f64, device=device)
        self._shifts = xp.asarray(np.ldexp(1.0, -np.arange(WIDTH)), dtype=f64, device=device)

    def __call__(self, host: list[int], scale: Any = None, growth: Any = None, backoff: Any = None) -> Any:
        """The bits of ``host`` (every field's value, or the first five with the state arrays)."""
        xp, f64 = self.xp, self.xp.float64
        words = [xp.full((), float(v % 2**WIDTH), dtype=f64, device=self.device) for v in host]
        if scale is not None:
            s = xp.astype(scale, f64)
            above = s >= self._powers
            power = xp.max(xp.where(above, self._powers, xp.zeros_like(self._powers)))
            exponent = xp.sum(xp.astype(above, f64))  # the biased exponent, E + 127
            pattern = exponent * 2.0**23 + (s / power - 1.0) * 2.0**23  # the float32 bit pattern
            words += [pattern, xp.astype(growth, f64), xp.astype(backoff, f64)]
        stacked = xp.stack([xp.reshape(w, ()) for w in words])
        halves = xp.floor(stacked[:, None] * self._shifts[None, :])
        return xp.reshape(halves - 2.0 * xp.floor(halves / 2.0), (-1,))


def misaligned(bit_sums: np.ndarray, ranks: int) -> bool:
    """Whether any fingerprint bit was not the same on every rank (host side).

    Each sum s is in [0, ranks]; s * (ranks - s) is 0 exactly at 0 and ranks, so one exact dot
    product of small integers answers for all bits.
    """
    sums = np.asarray(bit_sums, np.float64)
    return bool(np.dot(sums, ranks - sums) != 0.0)


def describe(bit_sums: np.ndarray, ranks: int, mine: Fingerprint) -> str:
    """What differs between this rank and the others, e.g. "scale 2**10 on this rank, 2**20 on
    the other ranks"; fields are named in the order they explain a misalignment best."""
    sums = np.asarray(bit_sums, dtype=np.float64).reshape(len(FIELDS), WIDTH)
    own = host_bits(mine).astype(np.float64).reshape(len(FIELDS), WIDTH)
    others = sums - own  # each bit summed over the other ranks
    differs = np.any((sums != 0) & (sums != ranks), axis=1)
    value: dict[str, int | None] = {}
    for i, name in enumerate(FIELDS):
        agree = np.all((others[i] == 0) | (others[i] == ranks - 1))
        value[name] = int(np.dot(others[i] / (ranks - 1), 2.0 ** np.arange(WIDTH))) if agree else None
    parts = []
    if differs[FIELDS.index("iteration")] or differs[FIELDS.index("collective")] or differs[
            FIELDS.index("sequence")]:
        parts.append(_position(mine, value))
    for name in ("config", "payload", "scale", "growth_tracker", "backoff_tracker"):
        if differs[FIELDS.index(name)]:
            parts.append(_field(name, getattr(mine, name), value[name]))
    return "; ".join(parts)


def _position(mine: Fingerprint, other: dict[str, int | None]) -> str:
    here = f"collective {mine.collective} of iteration {mine.iteration} (the reducer's collective " \
           f"#{mine.sequence + 1}) on this rank"
    if None in (other["collective"], other["iteration"], other["sequence"]):
        return f"the ranks' collectives are not aligned: {here}, other positions on the other ranks"
    there = (f"collective {other['collective']} of iteration {other['iteration']} (#"
             f"{int(other['sequence']) + 1}) on the other ranks")
    return f"the ranks' collectives are not aligned: {here}, {there}"


def _field(name: str, mine: int, other: int | None) -> str:
    def show(v: int) -> str:
        if name == "scale":
            return f"scale {format_scale(_from_bits(v))}"
        label = "config fingerprint" if name == "config" else name
        return f"{v} values summed" if name == "payload" else f"{label} {v}"

    there = "other values on the other ranks (which differ among themselves too)" if other is None \
        else f"{show(other)} on the other ranks"
    return f"rank states differ: {show(mine)} on this rank, {there}"


def _from_bits(pattern: int) -> float:
    return float(np.array(pattern, np.uint32).view(np.float32))


def format_scale(value: float) -> str:
    """A scale as a person reads it: 2**k for powers of two, else the float32 value."""
    mantissa, exponent = math.frexp(value)
    return f"2**{exponent - 1}" if mantissa == 0.5 else f"{value:g}"
