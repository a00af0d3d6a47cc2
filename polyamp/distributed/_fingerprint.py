"""What every rank must hold equal, written as digits that the step's one SUM all-reduce checks.

An agreement message is ``[non-finite count, extra0, extra1, *digits, *squares]`` (float64, the
same length on every rank and call): each 32-bit field of :data:`FIELDS` as 4 bytes, and each
byte squared. Summed over n ranks, ``sum**2 == n * sum_of_squares`` holds for a byte exactly
when every rank sent the same byte (Cauchy-Schwarz; every number stays an exact integer in float64
below 2**21 ranks), so misalignment is found inside the collective that agrees the flag, at no
extra collective. The trainer's float32 gradient buffer carries the fields as bits instead (a
bit's sum is 0 or n; exact below 2**24 ranks), whose squares are the bits themselves. A field's
value on the other ranks is read back from the sums where they agree among themselves (always
with 2 ranks).
"""

from __future__ import annotations

import struct
from typing import Any, NamedTuple

import numpy as np

from .._skip_log import scale_text

#: The fields of a fingerprint, in message order (32 bits each).
FIELDS = ("config", "iteration", "collective", "sequence", "payload", "scale", "growth_tracker",
          "backoff_tracker")
WIDTH = 32
_MASK = 2**WIDTH - 1
_F32, _U32 = struct.Struct("<f"), struct.Struct("<I")


class Encoding(NamedTuple):
    """How the fields travel: ``digit_bits`` bits per value, and the squares after the digits."""

    digit_bits: int
    squares: bool

    @property
    def digits(self) -> int:
        """Digits per message (all fields)."""
        return len(FIELDS) * WIDTH // self.digit_bits

    @property
    def size(self) -> int:
        """Values per message: the digits, and their squares where they are not 0/1."""
        return self.digits * (2 if self.squares else 1)


#: float64 agreement messages: bytes and their squares (exact below 2**21 ranks).
BYTES = Encoding(8, True)
#: float32 gradient buffers (the data-parallel trainer): bits (exact below 2**24 ranks).
BITS = Encoding(1, False)
#: Elements before the fingerprint: the non-finite count and two extra values (a sum of squares pair).
HEAD = 3
MESSAGE = HEAD + BYTES.size


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


def encode(values: Fingerprint | list[int], encoding: Encoding = BYTES) -> np.ndarray:
    """The fingerprint as ``encoding.size`` float64 values (field by field, lowest digit first)."""
    octets = np.array([v & _MASK for v in values], dtype="<u4").view(np.uint8)
    if encoding.digit_bits == 1:
        return np.unpackbits(octets, bitorder="little").astype(np.float64)
    digits = octets.astype(np.float64)
    return np.concatenate([digits, digits * digits])


class DeviceEncoder:
    """Computes the encoding on the state's device, without a host read (for GPU arrays).

    Host fields enter as fills (kernel arguments, no host-to-device copy); the scale's bit
    pattern is rebuilt exactly from comparisons with the powers of two (no bit cast needed).
    """

    def __init__(self, xp: Any, device: Any, encoding: Encoding = BYTES) -> None:
        self.xp, self.device, self.encoding = xp, device, encoding
        f64 = xp.float64
        per_field = WIDTH // encoding.digit_bits
        self._powers = xp.asarray(np.ldexp(1.0, np.arange(-126, 128)), dtype=f64, device=device)
        steps = -encoding.digit_bits * np.arange(per_field)
        self._shifts = xp.asarray(np.ldexp(1.0, steps), dtype=f64, device=device)
        self._base = float(2**encoding.digit_bits)

    def __call__(self, host: list[int], scale: Any = None, growth: Any = None, backoff: Any = None) -> Any:
        """The encoding of ``host`` (every field's value, or the first five with the state arrays)."""
        xp, f64 = self.xp, self.xp.float64
        words = [xp.full((), float(v & _MASK), dtype=f64, device=self.device) for v in host]
        if scale is not None:
            s = xp.astype(scale, f64)
            above = s >= self._powers
            power = xp.max(xp.where(above, self._powers, xp.zeros_like(self._powers)))
            exponent = xp.sum(xp.astype(above, f64))  # the biased exponent, E + 127
            pattern = exponent * 2.0**23 + (s / power - 1.0) * 2.0**23  # the float32 bit pattern
            words += [pattern, xp.astype(growth, f64), xp.astype(backoff, f64)]
        stacked = xp.stack([xp.reshape(w, ()) for w in words])
        high = xp.floor(stacked[:, None] * self._shifts[None, :])
        digits = xp.reshape(high - self._base * xp.floor(high / self._base), (-1,))
        return xp.concat([digits, digits * digits]) if self.encoding.squares else digits

    def misaligned(self, sums: Any, ranks: int) -> Any:
        """A 0-d bool on the device: True when some digit differed between the ranks."""
        xp = self.xp
        sums = xp.astype(sums, xp.float64)
        n = self.encoding.digits
        squares = sums[n:] if self.encoding.squares else sums
        return xp.any(sums[:n] * sums[:n] != float(ranks) * squares)


def _split(sums: np.ndarray, encoding: Encoding) -> tuple[np.ndarray, np.ndarray]:
    sums = np.asarray(sums, dtype=np.float64)
    n = encoding.digits
    return (sums[:n], sums[n:]) if encoding.squares else (sums, sums)


def misaligned(sums: np.ndarray, ranks: int, encoding: Encoding = BYTES) -> bool:
    """Whether any digit was not the same on every rank (host side)."""
    digits, squares = _split(sums, encoding)
    return bool(np.any(digits * digits != ranks * squares))


def describe(sums: np.ndarray, ranks: int, mine: Fingerprint, encoding: Encoding = BYTES) -> str:
    """What differs between this rank and the others, e.g. "scale 2**10 on this rank, 2**20 on
    the other ranks"; fields are named in the order they explain a misalignment best."""
    digits, squares = _split(sums, encoding)
    own, _ = _split(encode(mine, encoding), encoding)
    per_field = WIDTH // encoding.digit_bits
    shape = (len(FIELDS), per_field)
    digits, squares, own = digits.reshape(shape), squares.reshape(shape), own.reshape(shape)
    differs = np.any(digits * digits != ranks * squares, axis=1)
    others, others_sq = digits - own, squares - own * own  # each digit summed over the other ranks
    weights = 2.0 ** (encoding.digit_bits * np.arange(per_field))
    value: dict[str, int | None] = {}
    for i, name in enumerate(FIELDS):
        agree = np.all(others[i] * others[i] == (ranks - 1) * others_sq[i])
        value[name] = int(np.dot(others[i] / (ranks - 1), weights)) if agree else None
    parts = []
    if any(differs[FIELDS.index(f)] for f in ("iteration", "collective", "sequence")):
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
            return f"scale {scale_text(_from_bits(v))}"
        label = "config fingerprint" if name == "config" else name
        return f"{v} values summed" if name == "payload" else f"{label} {v}"

    there = "other values on the other ranks (which differ among themselves too)" if other is None \
        else f"{show(other)} on the other ranks"
    return f"rank states differ: {show(mine)} on this rank, {there}"


def _from_bits(pattern: int) -> float:
    return float(np.array(pattern, np.uint32).view(np.float32))
