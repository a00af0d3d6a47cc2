"""The engine's link to a reducer: one SUM all-reduce per step agrees the overflow flag.

Every rank sums ``[non-finite count, *extra]`` (``extra``: e.g. the local sum of squares of a
global-norm clip) in one collective, so all ranks see the same count and skip together. The
scaler's first agreement also checks that every rank holds the same config (one more
collective, that step only). ``polyamp.distributed`` is imported only when a reducer is given.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

import array_api_compat
import numpy as np

from .config import LossScaleConfig

if TYPE_CHECKING:  # the annotation only: importing polyamp must not import polyamp.distributed
    from .distributed import Reducer


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

    def _sum_(self, buffer: Any, config: LossScaleConfig) -> None:
        """All-reduce ``buffer`` in place (SUM); the first time, check the config before it."""
        if not self.config_checked:
            from .distributed import check_same_config

            check_same_config(self.reducer, config, like=buffer)
            self.config_checked = True
        self.reducer.allreduce_sum_(buffer)

    def flag(self, found_inf: Any, config: LossScaleConfig) -> Any:
        """A new array: ``found_inf`` summed over ranks (one collective; ``found_inf`` is kept)."""
        buffer = _copy(found_inf)
        self._sum_(buffer, config)
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
        self._sum_(buffer, config)
        agreed = xp.astype(xp.reshape(buffer[:1], ()), xp.float32)
        return Agreed(agreed, xp.reshape(buffer[1:], extra.shape))


def _copy(array: Any) -> Any:
    """A new array equal to ``array`` (0-d stays 0-d), in its library, on its device."""
    if isinstance(array, (np.ndarray, np.generic)):
        return np.array(array, copy=True)  # an ndarray even for a NumPy scalar
    clone = getattr(array, "clone", None)  # torch, paddle
    if callable(clone):
        return clone()
    return array_api_compat.array_namespace(array).asarray(array, copy=True)

