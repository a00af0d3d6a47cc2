"""What a :class:`polyamp.PrecisionMeter` found on one sample step, and what to do about it: built
on the host from the counts summed and max-reduced over the ranks, so every rank builds the same.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ._precision_advice import advise, percent
from ._precision_counts import TARGET_FIELDS, Layout
from ._precision_targets import Target, scale_text

__all__ = ["PrecisionReport", "TargetCounts", "TensorPrecision"]

@dataclass(frozen=True)
class TargetCounts:
    """One target's counts: values that underflow (the cast gives 0), turn subnormal, or overflow."""

    underflow: int
    subnormal: int
    overflow: int


@dataclass(frozen=True)
class TensorPrecision:
    """One gradient's counts: ``targets`` holds one :class:`TargetCounts` per report target, in order.
    ``amin`` is None when no value is finite and non-zero."""

    name: str
    numel: int
    zeros: int
    nonfinite: int
    amax: float
    amin: float | None
    targets: tuple[TargetCounts, ...]

    @property
    def measured(self) -> int:
        """The finite non-zero values: what a cast can lose, the fractions' denominator."""
        return self.numel - self.zeros - self.nonfinite


@dataclass(frozen=True)
class PrecisionReport:
    """One sample step's precision: per gradient and in total, per target, what the scale leaves.
    ``step`` and ``scale`` are None where not known (``polyamp advise``); ``str()`` is a table."""

    step: int | None
    scale: float | None
    targets: tuple[Target, ...]
    tensors: tuple[TensorPrecision, ...]

    @classmethod
    def from_arrays(cls, step: int | None, scale: float | None, targets: Sequence[Target],
                    names: Sequence[str], counts: Any, extremes: Any) -> PrecisionReport:
        """The report from host ``counts`` and ``extremes`` (one rank's, or summed and max-reduced
        over the ranks); ``names`` names the gradients in the order counted."""
        layout = Layout(len(names), len(targets))
        got = (len(counts), len(extremes))
        if got != layout.sizes:
            raise ValueError(
                f"counts and extremes must hold {layout.sizes[0]} and {layout.sizes[1]} values for "
                f"{len(names)} gradients and {len(targets)} targets, got {got[0]} and {got[1]}. Fix: pass "
                "the arrays PrecisionMeter.count made for these gradients, and one name per gradient."
            )
        tensors = tuple(
            TensorPrecision(str(name), *row.counts, row.amax, row.amin,
                            tuple(TargetCounts(*c) for c in row.targets))
            for name, row in zip(names, layout.rows(counts, extremes)))
        return cls(None if step is None else int(step), None if scale is None else float(scale),
                   tuple(targets), tensors)

    @property
    def numel(self) -> int:
        return sum(t.numel for t in self.tensors)

    @property
    def measured(self) -> int:
        """The finite non-zero values of every gradient."""
        return sum(t.measured for t in self.tensors)

    @property
    def amax(self) -> float:
        """The largest finite ``|g|`` of every gradient (0.0 when none)."""
        return max((t.amax for t in self.tensors), default=0.0)

    @property
    def totals(self) -> dict[str, TargetCounts]:
        """target label (``float16@loss``) -> its counts summed over the gradients."""
        return {t.label: TargetCounts(*(sum(getattr(x.targets[j], f) for x in self.tensors)
                                        for f in TARGET_FIELDS))
                for j, t in enumerate(self.targets)}

    def fractions(self) -> dict[str, float]:
        """``underflow_fraction/<label>``, ``subnormal_fraction/<label>`` and ``overflow_fraction/<label>``
        of the finite non-zero values (0.0 where there are none): what ``metrics()`` logs."""
        measured = self.measured
        return {f"{field}_fraction/{label}": getattr(counts, field) / measured if measured else 0.0
                for label, counts in self.totals.items() for field in TARGET_FIELDS}

    def effective_scale(self, target: Target) -> float | None:
        """The number ``target``'s values were multiplied by: the loss scale for "loss", its number,
        None for "amax" (a scale per tensor) or for "loss" without a scale."""
        if target.scale == "amax":
            return None
        return self.scale if target.scale == "loss" else float(target.scale)

    def suggested_scale(self, target: Target) -> float | None:
        """The largest power of two ``2**k`` with ``amax * 2**k <= M / 2`` for ``target``'s format, at most
        float64's largest, 2**1023 (None when no value is finite and non-zero)."""
        if self.amax <= 0:
            return None
        half, k = math.frexp(target.format.max / 2)  # exact: compare the mantissas, add the exponents
        mantissa, exponent = math.frexp(self.amax)
        return math.ldexp(1.0, min(k - exponent - (mantissa > half), 1023))

    @property
    def advice(self) -> tuple[str, ...]:
        """Short sentences a person can act on (see docs/precision.md, "Reading the advice")."""
        return advise(self)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-serialisable data: the fields, the totals, the fractions and the advice."""
        def counts(c: TargetCounts) -> dict[str, int]:
            return {f: getattr(c, f) for f in TARGET_FIELDS}

        return {
            "step": self.step, "scale": self.scale,
            "targets": [{"label": t.label, "dtype": t.format.name, "scale": t.scale,
                         "format": {"exponent_bits": t.format.exponent_bits,
                                    "mantissa_bits": t.format.mantissa_bits, "encoding": t.format.encoding}}
                        for t in self.targets],
            "tensors": [{"name": x.name, "numel": x.numel, "zeros": x.zeros, "nonfinite": x.nonfinite,
                         "amax": x.amax, "amin": x.amin,
                         "targets": {t.label: counts(c) for t, c in zip(self.targets, x.targets)}}
                        for x in self.tensors],
            "totals": {label: counts(c) for label, c in self.totals.items()},
            "fractions": self.fractions(), "advice": list(self.advice),
        }

    def __str__(self) -> str:
        scale = "no loss scale given" if self.scale is None else f"loss scale {scale_text(self.scale)}"
        zeros = sum(t.zeros for t in self.tensors)
        nonfinite = sum(t.nonfinite for t in self.tensors)
        step = "" if self.step is None else f", step {self.step}"
        many = "gradient" if len(self.tensors) == 1 else "gradients"
        lines = [f"precision report{step}, {scale}: {len(self.tensors)} {many}, "
                 f"{self.numel:,} values ({zeros:,} zero, {nonfinite:,} inf/nan)",
                 "per target: underflow / subnormal / overflow, as % of the finite non-zero values"]
        head = ("name", "values", "amax", "amin", *(t.label for t in self.targets))
        amin = min((x.amin for x in self.tensors if x.amin is not None), default=None)
        total = TensorPrecision("total", self.numel, zeros, nonfinite, self.amax, amin,
                                tuple(self.totals.values()))
        rows = [head] + [_row(x) for x in (*self.tensors, total)]
        widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
        lines += ["  " + "  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                                   for i, (c, w) in enumerate(zip(r, widths))).rstrip() for r in rows]
        lines.append("advice:")
        lines += [f"  - {sentence}" for sentence in self.advice]
        return "\n".join(lines)


def _row(x: TensorPrecision) -> tuple[str, ...]:
    cells = [" / ".join(percent(getattr(c, f), x.measured) for f in TARGET_FIELDS) for c in x.targets]
    return (x.name, f"{x.numel:,}", f"{x.amax:.3g}", "-" if x.amin is None else f"{x.amin:.3g}", *cells)
