"""The formats a :class:`polyamp.PrecisionMeter` measures against, and their exact thresholds: from the
format's parameters (no library imported), each a sum of two powers of two float64 holds exactly.
"""

from __future__ import annotations

import math
from typing import Literal, NamedTuple

#: How a format spends its top exponent: "ieee" keeps it for inf/nan (float16, bfloat16,
#: float8_e5m2); "fn" uses it for finite values except the all-ones mantissa (NaN; float8_e4m3fn);
#: "fnuz" has no inf, NaN at the negative zero, and a bias one larger (float8_e4m3fnuz).
Encoding = Literal["ieee", "fn", "fnuz"]


class FloatFormat(NamedTuple):
    """A binary floating-point format by its parameters; ``name`` is what reports call it."""

    name: str
    exponent_bits: int
    mantissa_bits: int
    encoding: Encoding = "ieee"

    @property
    def bias(self) -> int:
        return 2 ** (self.exponent_bits - 1) - (0 if self.encoding == "fnuz" else 1)

    @property
    def smallest_normal(self) -> float:
        """``n``: 2**(1 - bias)."""
        return math.ldexp(1.0, 1 - self.bias)

    @property
    def smallest_subnormal(self) -> float:
        """``m``: n * 2**-mantissa_bits."""
        return math.ldexp(1.0, 1 - self.bias - self.mantissa_bits)

    @property
    def max_exponent(self) -> int:
        top = 2**self.exponent_bits - 1  # the all-ones exponent: finite only for "fn" and "fnuz"
        return top - self.bias - (1 if self.encoding == "ieee" else 0)

    @property
    def max(self) -> float:
        """``M``: the largest finite value (e4m3fn's all-ones mantissa is NaN: one step less)."""
        drop = (2 if self.encoding == "fn" else 1) * math.ldexp(1.0, -self.mantissa_bits)
        return (2.0 - drop) * math.ldexp(1.0, self.max_exponent)

    @property
    def ulp_of_max(self) -> float:
        """``ulp(M)``: the spacing of values in M's binade."""
        return math.ldexp(1.0, self.max_exponent - self.mantissa_bits)


#: The named formats a target may give as a string; others are given as a FloatFormat.
FORMATS = {f.name: f for f in (
    FloatFormat("float16", 5, 10), FloatFormat("bfloat16", 8, 7),
    FloatFormat("float8_e4m3fn", 4, 3, "fn"), FloatFormat("float8_e5m2", 5, 2),
)}

#: The scales a target may name instead of a number: this step's loss scale, or per-tensor
#: current scaling (``max(dtype) / amax`` of each tensor, 1 when its amax is 0).
NAMED_SCALES = ("loss", "amax")


class Bounds(NamedTuple):
    """One target as a backend counts it: its scale and its thresholds on ``|v|`` (host floats).

    underflow: ``0 < |v| <= underflow_max``; subnormal: ``underflow_max < |v| < subnormal_below``;
    overflow: ``|v| >= overflow_from``; ``max_finite`` is the numerator of the "amax" scale.
    """

    scale: str | float  # "loss", "amax" or the number
    underflow_max: float  # m / 2
    subnormal_below: float  # n - m / 2
    overflow_from: float  # M + ulp(M) / 2
    max_finite: float  # M


class Target(NamedTuple):
    """One ``(format, scale)`` a meter measures: what the gradients would lose cast to ``format``
    after multiplying them by ``scale`` ("loss", "amax" or a number)."""

    format: FloatFormat
    scale: str | float

    @property
    def label(self) -> str:
        """``float16@loss``, ``bfloat16@1``, ``float8_e4m3fn@amax``: the target's name in metrics."""
        return f"{self.format.name}@{scale_label(self.scale)}"

    def bounds(self) -> Bounds:
        f = self.format
        half = f.smallest_subnormal / 2
        return Bounds(self.scale, half, f.smallest_normal - half, f.max + f.ulp_of_max / 2, f.max)


def scale_label(scale: str | float) -> str:
    """A scale as short text that reads back as the same number: "loss", "1", "0.5", "1048576.0"."""
    if isinstance(scale, str):
        return scale
    short = format(scale, "g")
    return short if float(short) == scale else repr(float(scale))


def scale_text(scale: float) -> str:
    """A scale for sentences: ``2**10`` for a power of two beyond 8, else its short form ("1", "0.5")."""
    mantissa, exponent = math.frexp(scale)
    return f"2**{exponent - 1}" if mantissa == 0.5 and not 1 <= exponent <= 4 else scale_label(scale)
