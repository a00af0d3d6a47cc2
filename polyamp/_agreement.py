"""The across-ranks half of LossScaler: one SUM all-reduce per step agrees the overflow flag.

Every rank sums ``[non-finite count, *extra]`` (``extra``: e.g. the local sum of squares of a
global-norm clip) in one collective, so all ranks see the same count and skip together. The
scaler's first agreement also checks that every rank holds the same config (one more
collective, that step only). ``polyamp.distributed`` is imported only when a reducer is given.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import array_api_compat
import numpy as np

from ._errors import ScalerStateError
from .config import LossScaleConfig

if TYPE_CHECKING:  # the annotation only: importing polyamp must not import polyamp.distributed
    from .backend import Backend
    from .distributed import Reducer
    from .policy import LossScaleState

#: The loop every scaler message points to.
LOOP = "stepped = scaler.step(grads, step_fn); scaler.update()"


class Agreed(NamedTuple):
    """What :meth:`polyamp.LossScaler.agree_` returns: device arrays, nothing read on the host.

    ``found_inf``: the iteration's non-finite count summed over ranks (0-d float32, on the
    scaler's device; non-zero means every rank skips). ``extra``: the ``extra`` given, summed
    over ranks (same shape and dtype), or None.
    """

    found_inf: Any
    extra: Any


class Agreement:
    """A reducer plus whether the config was checked: what ``LossScaler(reducer=...)`` holds."""

    def __init__(self, group: Any) -> None:
        from .distributed import reducer  # only here: `import polyamp` stays free of it

        self.reducer: Reducer = reducer(group)
        self.config_checked = False

    def __deepcopy__(self, memo: dict) -> Agreement:
        """A copy of a scaler is a new scaler: same reducer, config checked again at its first step."""
        return Agreement(self.reducer)

    def check_config(self, config: LossScaleConfig, like: Any) -> None:
        """The first time only: ConfigError on every rank unless all hold ``config`` (one MAX
        all-reduce, its buffer where ``like`` lives)."""
        if not self.config_checked:
            from .distributed import check_same_config

            check_same_config(self.reducer, config, like=like)
            self.config_checked = True

    def sum_(self, buffer: Any, config: LossScaleConfig) -> None:
        """All-reduce ``buffer`` in place (SUM); the first time, check the config before it."""
        self.check_config(config, like=buffer)
        self.reducer.allreduce_sum_(buffer)

    def flag(self, found_inf: Any, config: LossScaleConfig) -> Any:
        """A new array: ``found_inf`` summed over ranks (one collective; ``found_inf`` is kept)."""
        buffer = _copy(found_inf)
        self.sum_(buffer, config)
        return buffer

    def flag_and_extra(self, found_inf: Any, extra: Any, config: LossScaleConfig) -> Agreed:
        """``found_inf`` and ``extra`` summed over ranks in ONE collective, in ``extra``'s dtype.

        The count travels in ``extra``'s dtype (counts are small integers: exact in any float);
        the agreed count comes back as float32 on ``extra``'s device.
        """
        xp = array_api_compat.array_namespace(extra)
        device = array_api_compat.device(extra)
        count = xp.asarray(found_inf, device=device)  # e.g. a NumPy flag of a rank without gradients
        buffer = xp.concat([xp.reshape(xp.astype(count, extra.dtype), (1,)), xp.reshape(extra, (-1,))])
        self.sum_(buffer, config)
        agreed = xp.astype(xp.reshape(buffer[:1], ()), xp.float32)
        return Agreed(agreed, xp.reshape(buffer[1:], extra.shape))


class Agreeing:
    """LossScaler's methods for a scaler built with ``reducer=`` (its ``_agreement``).

    The engine keeps the iteration's state (``_pending`` flag, ``_agreed``, ``_skipped``);
    these methods sum it over the ranks, at most once per iteration.
    """

    _agreement: Agreement | None
    _pending: Any
    _agreed: bool
    _skipped: bool | None
    _config: LossScaleConfig
    _state: LossScaleState | None
    _ready_backend: Callable[[], Backend]  # the engine's: its backend, state made if none

    @property
    def reducer(self) -> Any:
        """The ``polyamp.distributed.Reducer`` that agrees each step across ranks, or None."""
        return None if self._agreement is None else self._agreement.reducer

    def _refuse_after_agreement(self, what: str) -> None:
        if self._agreed:
            raise ScalerStateError(
                f"{what} was called after agree_() in the same iteration: the overflow flag is "
                "already summed over the ranks, and a flag added now would be this rank's alone. "
                "Fix: unscale and record every flag before agree_() (a non-finite global norm "
                "needs no flag: the agreed count already has its non-finite gradients)."
            )

    def agree_(self, extra: Any = None) -> Agreed:
        """Sum this iteration's overflow check over the ranks now, with ``extra`` in the same collective.

        ONE SUM all-reduce of ``[non-finite count, *extra]`` (in ``extra``'s dtype, on its device;
        ``extra`` e.g. a local sum of squares, as ``polyamp.grads`` clipping sends). ``step`` then
        reads the agreed flag and issues no collective of its own. Returns ``Agreed(found_inf,
        extra)``, both summed over ranks; without a reducer the local values, and nothing is sent.
        After ``unscale_``, before ``step``, once per iteration. No host synchronisation.
        """
        when = ("after step()" if self._skipped is not None else
                "before any unscale_()" if self._pending is None else "twice" if self._agreed else None)
        if when is not None:
            raise ScalerStateError(
                f"agree_() was called {when} in this iteration (global_norm and clip_grad_norm_ with a "
                "distributed scaler= call it). Fix: call it once, after unscale_(grads) and before "
                f"step() (the loop is `{LOOP}`)."
            )
        if self._agreement is None:
            return Agreed(self._pending, extra)
        if extra is None:
            agreed = Agreed(self._agreement.flag(self._pending, self._config), None)
        else:
            agreed = self._agreement.flag_and_extra(self._pending, extra, self._config)
        self._pending, self._agreed = agreed.found_inf, True
        return agreed

    def agree_flag(self, found_inf: Any) -> Any:
        """``found_inf`` summed over the ranks, as a new device array (``found_inf`` is kept).

        For facades that keep their own per-optimizer flags (paddle's ``step`` uses the last
        ``unscale_``'s): one collective, plus the config check at the scaler's first agreement.
        None (a rank without gradients) sends 0, a host bool (a copy's) 0 or 1. Without a
        reducer: ``found_inf`` as it is.
        """
        if self._agreement is None:
            return found_inf
        if found_inf is None or isinstance(found_inf, bool):
            backend = self._ready_backend()
            found_inf = backend.full(float(bool(found_inf)), "float32", self._state.scale)  # type: ignore[union-attr]
        return self._agreement.flag(found_inf, self._config)

    def _agree_pending(self) -> None:
        """With a reducer, sum the pending check over the ranks unless agree_() already did."""
        if self._agreement is not None and not self._agreed and self._pending is not None:
            self._pending, self._agreed = self._agreement.flag(self._pending, self._config), True


def _copy(array: Any) -> Any:
    """A new array equal to ``array`` (0-d stays 0-d), in its library, on its device."""
    if isinstance(array, (np.ndarray, np.generic)):
        return np.array(array, copy=True)  # an ndarray even for a NumPy scalar
    clone = getattr(array, "clone", None)  # torch, paddle
    if callable(clone):
        return clone()
    return array_api_compat.array_namespace(array).asarray(array, copy=True)

