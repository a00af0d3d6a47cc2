"""The precision meter inside an iteration: a sample step's gradients counted once unscaled (no host
read), the counts riding after the guard's values in the step's ONE collective, and the report built by
one host read after the decision. Without a meter every call is a no-op.
"""

from __future__ import annotations

import functools
import math
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import array_api_compat
import numpy as np

from ._agreement import Agreed
from ._digest import content_digest, to_bytes
from .config import short_repr
from .overflow import name_gradients

if TYPE_CHECKING:  # annotations only: `import polyamp` loads the meter on first use
    from .precision import PrecisionMeter, PrecisionReport


def check_meter(meter: Any) -> PrecisionMeter | None:
    """``meter`` when it is a :class:`polyamp.PrecisionMeter` or None; TypeError naming it otherwise."""
    precision = sys.modules.get("polyamp.precision")  # a PrecisionMeter exists only once it is loaded
    if meter is None or precision is not None and isinstance(meter, precision.PrecisionMeter):
        return meter
    raise TypeError(
        f"meter must be a polyamp.PrecisionMeter or None, got meter={short_repr(meter)} "
        f"({type(meter).__name__}). Fix: pass e.g. meter=polyamp.PrecisionMeter(every=100), or leave "
        "meter out."
    )


class Sample(NamedTuple):
    """One sample step's counts so far (immutable; replaced as gradients are counted and agreed)."""

    step: int  # steps taken before this one
    scale: Any  # the 0-d scale the gradients were unscaled with
    names: tuple[str, ...] = ()
    parts: tuple[Any, ...] = ()  # one polyamp.precision.Measured per unscale call
    agreed: Any = None  # the vector of :meth:`Metering.vector` agreed over the ranks


class Metering:
    """A :class:`polyamp.PrecisionMeter` (or None: every call a no-op) and its last report."""

    def __init__(self, meter: PrecisionMeter | None) -> None:
        self.meter = meter
        self.last: PrecisionReport | None = None
        self._digest = b"" if meter is None else to_bytes(meter.digest())
        self.active = meter is not None  # a plain attribute: the iteration reads it on every step

    def due(self, unscaled: bool, steps: int, sample: Sample | None) -> bool:
        """Whether the next unscale's gradients are counted: at the iteration's first unscale (not
        ``unscaled`` yet) when ``steps`` taken make a sample step, later while it samples."""
        return self.meter is not None and (sample is not None if unscaled else self.meter.samples(steps))

    def fuses(self, checks: Any, steps: int, scaling: Any, arrays: list[Any], plain: bool) -> bool:
        """Whether a ``plain`` unscale (not check-only, kept or fused with squares) of ``arrays`` due
        to be counted counts them in its own pass (on a backend with ``unscale_and_count``)."""
        return (plain and bool(arrays) and scaling.state is not None and scaling.backend is not None
                and scaling.backend.unscale_and_count is not None
                and self.due(checks.unscaled, steps, checks.metered))

    def unscale(self, checks: Any, steps: int, scaling: Any, arrays: list[Any], check_only: bool, keep: bool,
                squares: bool) -> tuple[Any, Any, Any]:
        """``(found, sumsq, counted)``: counted in the same pass where :meth:`fuses`, else unscaled keeping
        the values to count on a sample step (paddle's kernel writes ``grad * 0`` on an overflow). No sync."""
        if self.fuses(checks, steps, scaling, arrays, not (check_only or keep or squares)):
            found, counted = scaling.unscale_counted(arrays, self.meter.bounds())
            return found, None, counted
        keep = keep or self.due(checks.unscaled, steps, checks.metered)
        return (*scaling.unscale(arrays, check_only=check_only, keep=keep, squares=squares), None)

    def count(self, checks: Any, steps: int, scaling: Any, given: Sequence[Any], names: list[str] | None,
              arrays: list[Any] | bool, counted: Any = None) -> Sample | None:
        """``checks.metered`` with the unscaled ``arrays`` counted when :meth:`due` (``given`` named as
        the overflow report names them; False: only checked, still scaled, so not counted; ``counted``:
        their ``(counts, extremes)`` from the fused unscale). No host read."""
        sample = checks.metered
        if not self.due(checks.unscaled, steps, sample) or arrays is False and sample is None:
            return sample  # only checked, still scaled: no exact count, so no report of nothing
        backend, scale = scaling.backend, scaling.state.scale
        sample = Sample(steps, scale + 0) if sample is None else sample  # a copy: update() moves it
        if not arrays:
            return sample
        named = tuple(n for n, _ in name_gradients(list(given), names, len(sample.names)))
        measured = self.meter.count(backend, arrays, scale) if counted is None else _measured(*counted)
        return sample._replace(names=sample.names + named, parts=(*sample.parts, measured))

    def vector(self, sample: Sample, backend: Any = None) -> Any:
        """``[counts..., amaxes..., -amins..., scale]`` in float64 on the gradients' device (no read);
        arrays array-api-compat does not know (paddle's) are packed by ``backend``."""
        if not array_api_compat.is_array_api_obj(sample.scale):
            return backend.pack([*_ordered(sample.parts), sample.scale], sample.scale)
        xp = array_api_compat.array_namespace(sample.scale)
        flat = [xp.reshape(xp.astype(a, xp.float64), (-1,)) for a in _ordered(sample.parts)]
        return xp.concat([*flat, xp.reshape(xp.astype(sample.scale, xp.float64), (1,))])

    def whose(self, whose: int, steps: int) -> int:
        """``whose`` with the meter's settings and sampling phase (``steps % every``, at 0 ``steps``, which
        a report names) folded in: a rank whose meter differs, or samples at other steps, is misaligned."""
        if self.meter is None:
            return whose
        return _folded(whose, self._digest, steps % self.meter.every or steps)

    def agree(self, agreement: Any, found: Any, both: Any, maxed: tuple[bool, ...], sample: Sample | None,
              scaling: Any, whose: int) -> tuple[Agreed, Sample | None]:
        """``found`` and ``both`` (the user's and the guard's values) agreed in ONE collective, the
        sample's vector after them on a sample step; ``both`` comes back in its dtype and shape."""
        config, state = scaling.config, scaling.fingerprinted  # ``whose``: :meth:`whose` folded in
        if sample is None:
            return agreement.flag_and_extra(found, both, config, state, whose=whose, maxed=maxed), None
        mine = self.vector(sample, scaling.backend)
        xp = array_api_compat.array_namespace(mine) if array_api_compat.is_array_api_obj(mine) else None
        head = 0 if both is None else math.prod(tuple(both.shape))
        sent = mine if both is None else (scaling.backend.pack([both, mine], mine) if xp is None else
                                          xp.concat([xp.reshape(xp.astype(both, xp.float64), (-1,)), mine]))
        counted = sum(math.prod(tuple(p.counts.shape)) for p in sample.parts)
        rules = (*maxed, *(False,) * (head - len(maxed)), *(False,) * counted,
                 *(True,) * (mine.shape[0] - counted))
        agreed = agreement.flag_and_extra(found, sent, config, state, whose=whose, maxed=rules,
                                          metered=mine.shape[0])
        rest = None if both is None else _shaped(xp, agreed.extra[:head], both)
        return Agreed(agreed.found_inf, rest), sample._replace(agreed=agreed.extra[head:])

    def commit(self, checks: Any, backend: Any, agreement: Any = None) -> None:
        """After the decision: :attr:`last` from ``checks.metered`` (ONE host read), if this step sampled
        and, with an ``agreement``, its counts were agreed or summed with the gradients (not after
        ``update(found_inf=)`` or ``set_scale``: no report rather than this rank's as the step's)."""
        sample = checks.metered
        if sample is None or agreement is not None and sample.agreed is None and not checks.summed:
            return
        vector = self.vector(sample, backend) if sample.agreed is None else sample.agreed
        host = np.asarray(backend.to_numpy(vector), np.float64).reshape(-1)
        counted = sum(math.prod(tuple(p.counts.shape)) for p in sample.parts)
        counts = host[:counted].astype(np.int64)
        self.last = self.meter.report(sample.step, float(host[-1]), sample.names, counts, host[counted:-1])


@functools.lru_cache(maxsize=1024)
def _folded(whose: int, digest: bytes, at: int) -> int:
    return content_digest(to_bytes(whose), digest, to_bytes(at))


def _measured(counts: Any, extremes: Any) -> Any:
    from ._precision_counts import Measured  # loaded with the meter, not with polyamp

    return Measured(counts, extremes)


def _shaped(xp: Any, values: Any, like: Any) -> Any:
    """``values`` in ``like``'s dtype and shape (``xp`` None: a paddle tensor, by its methods)."""
    if xp is None:
        return values.astype(like.dtype).reshape(list(like.shape))
    return xp.reshape(xp.astype(values, like.dtype), tuple(like.shape))


def _ordered(parts: tuple[Any, ...]) -> list[Any]:
    """The parts' arrays in the report's layout: every part's counts, then every amax, then every
    -amin (each part's extremes hold its amaxes, then its -amins)."""
    halves = [(p.extremes[: p.extremes.shape[0] // 2], p.extremes[p.extremes.shape[0] // 2:]) for p in parts]
    return [p.counts for p in parts] + [h[0] for h in halves] + [h[1] for h in halves]
