"""The advice of a :class:`polyamp.PrecisionReport`: per target, one sentence on what it loses in
total and one for each of the worst gradients, naming it, what it loses and the scale that fixes it.
"""

from __future__ import annotations

import math
from typing import Any

from ._precision_targets import scale_text

__all__ = ["advise", "percent"]

#: A gradient gets a sentence once this share of its non-zero values underflows (or any overflows).
UNDERFLOW_NOTE = 0.01
#: A target "loses nothing" below this share lost; its subnormals are mentioned from UNDERFLOW_NOTE on.
NEGLIGIBLE = 0.001
#: At most this many gradients get a sentence per target (the worst first).
MAX_SENTENCES = 5


def advise(report: Any) -> tuple[str, ...]:
    """The sentences for ``report`` (a PrecisionReport), the whole first, then per target."""
    sentences = []
    nonfinite = sum(x.nonfinite for x in report.tensors)
    if nonfinite:
        sentences.append(f"{nonfinite:,} gradient {_values(nonfinite)} inf/nan and left out of the counts "
                         "(a step with them is skipped; polyamp.explain_overflow names the gradients)")
    if not report.measured:
        return (*sentences, "every gradient value is zero or inf/nan: nothing to measure")
    for j, target in enumerate(report.targets):
        sentences += _for_target(report, j, target)
    return tuple(sentences)


def _for_target(report: Any, j: int, target: Any) -> list[str]:
    fmt = target.format.name
    scale = report.effective_scale(target)
    where = f"{fmt} with per-tensor amax scaling" if target.scale == "amax" else (
        f"{fmt} at scale {_scale(scale)}")
    best = None if scale is None else report.suggested_scale(target)
    knob = "init_scale=" if target.scale == "loss" else "a scale of "
    counts = list(report.totals.values())[j]
    measured = report.measured
    lost = counts.underflow + counts.overflow
    if lost / measured < NEGLIGIBLE:
        why = "" if scale is None else (f": loss scaling is not needed for {fmt}" if scale == 1.0 else
                                         ": this scale keeps the gradients")
        head = f"{where} loses {percent(lost, measured)} here{why}"
    else:
        head = (f"{where} loses {percent(lost, measured)} here ({percent(counts.underflow, measured)} "
                f"underflow, {percent(counts.overflow, measured)} overflow)")
        if best is not None and best != scale:
            head += (f"; {knob}{_scale(best)} is the largest power of two that keeps the largest gradient "
                     f"(amax {report.amax:.3g}) a binade or more below {fmt}'s max")
    if counts.subnormal / measured >= UNDERFLOW_NOTE:
        head += f"; {percent(counts.subnormal, measured)} are subnormal in {fmt} (fewer significant bits)"
    sentences = [head]
    worst = sorted(((x, x.targets[j]) for x in report.tensors if x.measured and (
        x.targets[j].overflow or x.targets[j].underflow / x.measured >= UNDERFLOW_NOTE)),
        key=lambda pair: -(pair[1].underflow + pair[1].overflow) / pair[0].measured)
    for x, c in worst[:MAX_SENTENCES]:
        parts = [f"{c.overflow:,} {_values(c.overflow, 'overflow')}"] if c.overflow else []
        if c.underflow / x.measured >= UNDERFLOW_NOTE:
            parts.append(f"{percent(c.underflow, x.measured)} of its non-zero values underflow")
        fix = _fix(report, x, c, target, scale, best, knob)
        sentences.append(f"{x.name}: {' and '.join(parts)} in {where}{fix}")
    if len(worst) > MAX_SENTENCES:
        more = len(worst) - MAX_SENTENCES
        sentences.append(f"{more} more gradients lose values in {where} (see the table)")
    return sentences


def _fix(report: Any, x: Any, c: Any, target: Any, scale: float | None, best: float | None, knob: str) -> str:
    """What fixes one gradient's loss: the suggested scale, or why no scale does."""
    fmt = target.format.name
    if best is None:  # per-tensor amax scaling: only underflow is possible, and no scale helps
        return f"; its values span more binades than {fmt} holds: keep it in a wider format"
    if c.overflow or best > scale:
        binades = math.floor(math.log2(target.format.max) - math.log2(x.amax) - math.log2(best))
        return (f"; {knob}{_scale(best)} keeps its amax {binades} {'binade' if binades == 1 else 'binades'} "
                f"below {fmt}'s max")
    return (f"; a larger scale would overflow the largest gradient (amax {report.amax:.3g}): its values "
            f"span more binades than {fmt} holds")


def _scale(scale: float | None) -> str:
    return "(not given)" if scale is None else scale_text(scale)


def _values(n: int, verb: str = "") -> str:
    """"values are" / "value is" (no verb), or "values overflow" / "value overflows"."""
    if not verb:
        return "value is" if n == 1 else "values are"
    return f"value {verb}s" if n == 1 else f"values {verb}"


def percent(count: int, measured: int) -> str:
    """``count`` as a share of ``measured``: "38 %", "2.5 %", "<0.1 %" (non-zero), "0.0 %"."""
    if not measured or not count:
        return "0.0 %"
    value = 100 * count / measured
    if value < 0.05:
        return "<0.1 %"
    return f"{value:.0f} %" if value >= 10 else f"{value:.1f} %"
