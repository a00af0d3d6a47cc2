"""The precision meter: what the loss scale leaves behind, counted exactly on sample steps.

``meter.count(...)`` makes two flat arrays on the gradients' device with no host read, and
``meter.report(...)`` turns them, read on the host, into a :class:`PrecisionReport` (docs/precision.md).
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._errors import ConfigError
from ._precision_counts import Layout, Measured
from ._precision_report import PrecisionReport, TargetCounts, TensorPrecision
from ._precision_targets import FORMATS, NAMED_SCALES, Bounds, FloatFormat, Target
from .config import _plain, fits_float, is_real, short_repr

__all__ = ["FloatFormat", "Measured", "PrecisionMeter", "PrecisionReport", "Target", "TargetCounts",
           "TensorPrecision"]


@dataclass(frozen=True, kw_only=True)
class PrecisionMeter:
    """Which steps are measured (the first and every ``every``-th after it) and against which
    ``targets`` (``(dtype, scale)`` pairs, stored as :class:`Target` tuples; docs/precision.md)."""

    every: int = 100
    targets: tuple[Any, ...] = (("float16", "loss"), ("bfloat16", 1.0))

    def __post_init__(self) -> None:
        every = _plain(self.every, integral=True)
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ConfigError(f"every must be an int >= 1 (a sample every that many steps), got "
                              f"every={short_repr(self.every)}. Fix: pass e.g. every=100.")
        object.__setattr__(self, "every", every)
        object.__setattr__(self, "targets", _targets(self.targets))

    def samples(self, steps_taken: int) -> bool:
        """Whether the step after ``steps_taken`` steps is a sample step (the first one is)."""
        return steps_taken % self.every == 0

    @property
    def needs_scale(self) -> bool:
        """Whether a target is measured at the loss scale (then :meth:`count` needs it)."""
        return any(t.scale == "loss" for t in self.targets)

    def bounds(self) -> tuple[Bounds, ...]:
        """Each target's scale and thresholds, as a backend's ``precision_counts`` takes them."""
        return tuple(t.bounds() for t in self.targets)

    def layout(self, tensors: int) -> Layout:
        """Where each value of :meth:`count`'s arrays sits, for ``tensors`` gradients."""
        return Layout(tensors, len(self.targets))

    def digest(self) -> int:
        """A 32-bit digest of the settings (what must be equal on every rank)."""
        settings = (self.every, tuple((tuple(t.format), t.scale) for t in self.targets))
        return zlib.crc32(repr(settings).encode())

    def count(self, backend: Any, grads: Sequence[Any], scale: Any = None) -> Measured:
        """``Measured(counts, extremes)`` of the unscaled ``grads`` (one library and device; :meth:`layout`),
        no host read; ``scale``: the step's loss scale (a 0-d array or a number) for "loss" targets."""
        if self.needs_scale:
            _check_scale(scale)
        if not grads:
            return Measured(np.zeros(0, np.int64), np.zeros(0, np.float64))
        return Measured(*backend.precision_counts(list(grads), scale, self.bounds()))

    def report(self, step: int | None, scale: float | None, names: Sequence[str], counts: Any,
               extremes: Any) -> PrecisionReport:
        """The :class:`PrecisionReport` from host ``counts`` and ``extremes`` (one rank's, or summed
        and max-reduced over the ranks), ``names`` naming the gradients in the order counted."""
        counts, extremes = np.asarray(counts).reshape(-1), np.asarray(extremes).reshape(-1)
        return PrecisionReport.from_arrays(step, scale, self.targets, list(names), counts, extremes)


def _check_scale(scale: Any) -> None:
    if isinstance(scale, np.ndarray) and scale.ndim == 0 or isinstance(scale, np.generic):
        scale = scale[()]  # a host number: checked as one (no device read)
    elif hasattr(scale, "shape"):  # a device's 0-d array (the step's own scale): its shape only, no read
        if math.prod(tuple(scale.shape)) != 1:
            raise ConfigError(f"scale must be one number (a 0-d or 1-element array), got an array of shape "
                              f"{tuple(scale.shape)}. Fix: pass the loss scale, e.g. scaler.get_scale().")
        return
    value = _plain(scale, integral=False)
    if not (is_real(value) and math.isfinite(value) and value > 0):
        raise ConfigError(f"scale must be the loss scale, a finite number > 0, for the meter's 'loss' "
                          f"targets, got scale={short_repr(scale)}. Fix: pass the scale the gradients "
                          "were scaled by (e.g. scaler.get_scale()), or only targets with a number.")


def _targets(targets: Any) -> tuple[Target, ...]:
    """``targets`` as Target tuples; ConfigError naming the entry otherwise."""
    if isinstance(targets, (str, bytes)) or not isinstance(targets, (tuple, list)) or not targets:
        raise ConfigError(f"targets must be a non-empty tuple of (dtype, scale) pairs, got targets="
                          f"{short_repr(targets)}. Fix: pass e.g. "
                          "targets=(('float16', 'loss'), ('bfloat16', 1.0)).")
    found: list[Target] = []
    for i, entry in enumerate(targets):
        if not isinstance(entry, (tuple, list)) or len(entry) != 2:
            raise ConfigError(f"targets[{i}] must be a (dtype, scale) pair, got {short_repr(entry)}. "
                              f"Fix: pass e.g. ('float16', 'loss') or ('bfloat16', 1.0).")
        target = Target(_format(i, entry[0]), _scale(i, entry[1]))
        if any(t.label == target.label for t in found):
            raise ConfigError(f"targets[{i}] repeats {target.label}: each (dtype, scale) is measured once. "
                              "Fix: leave the repeat out.")
        found.append(target)
    return tuple(found)


def _format(i: int, dtype: Any) -> FloatFormat:
    if isinstance(dtype, FloatFormat):
        return _checked_format(i, dtype)
    if not isinstance(dtype, str):  # a NumPy, torch, paddle or ml_dtypes dtype (or type)
        dtype = str(getattr(dtype, "name", None) or getattr(dtype, "__name__", dtype))
    name = dtype.rpartition(".")[2]  # torch.float16, paddle.bfloat16
    if name not in FORMATS:
        raise ConfigError(f"targets[{i}]'s dtype must be one of {list(FORMATS)} (a name or the library's "
                          f"dtype) or a polyamp.precision.FloatFormat, got {short_repr(dtype)}. "
                          "Fix: pass e.g. ('float16', 'loss').")
    return FORMATS[name]


def _checked_format(i: int, fmt: FloatFormat) -> FloatFormat:
    ok = (isinstance(fmt.name, str) and fmt.name and isinstance(fmt.exponent_bits, int)
          and isinstance(fmt.mantissa_bits, int) and 2 <= fmt.exponent_bits <= 11
          and 1 <= fmt.mantissa_bits <= 52 and fmt.encoding in ("ieee", "fn", "fnuz"))
    try:  # its largest value must be a float64 (11 exponent bits and "fn": 2**1024 is not)
        ok = ok and math.isfinite(fmt.max)
    except OverflowError:
        ok = False
    if not ok:
        raise ConfigError(f"targets[{i}]'s FloatFormat must have a name, 2 to 11 exponent bits, 1 to 52 "
                          f"mantissa bits and encoding 'ieee', 'fn' or 'fnuz', and a largest value float64 "
                          f"holds, got {short_repr(fmt, 120)}. "
                          "Fix: e.g. FloatFormat('float8_e4m3fnuz', 4, 3, 'fnuz').")
    return fmt


def _scale(i: int, scale: Any) -> str | float:
    if isinstance(scale, str) and scale in NAMED_SCALES:
        return scale
    value = _plain(scale, integral=False)
    if isinstance(value, int) and not isinstance(value, bool) and fits_float(value):
        value = float(value)
    if not isinstance(value, float) or not (math.isfinite(value) and value > 0):
        raise ConfigError(f"targets[{i}]'s scale must be 'loss', 'amax' or a finite number > 0, got "
                          f"{short_repr(scale)}. Fix: pass e.g. ('bfloat16', 1.0) or ('float16', 'loss').")
    return value
