"""Arrays of many shapes stored as views of one flat array, for any array library: whole-set
operations (fill, scale, cast, norm) cost one call instead of one per array.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Sequence
from itertools import accumulate
from typing import Any

import array_api_compat

from . import _dtypes
from ._errors import ConfigError

__all__ = ["FlatArrays"]


class FlatArrays:
    """One flat array and one view of it per shape; writes through either side show in both.

    ``like`` (an array) picks the library and device (NumPy when None); ``spare`` values follow
    the views in the same memory (:attr:`storage`).
    """

    def __init__(
        self, shapes: Iterable[Sequence[int]], dtype: Any = "float32", *, like: Any = None, spare: int = 0
    ) -> None:
        if shapes is None or isinstance(shapes, (str, bytes)) or not isinstance(shapes, Iterable):
            raise ConfigError(f"{type(self).__name__} needs shapes, a list of shapes, "
                              f"got shapes={shapes!r:.60}; pass e.g. [(3, 4), (4,)]")
        shapes = [_check_shape(s) for s in shapes]
        if not shapes:
            raise ConfigError(f"{type(self).__name__} got shapes=[]; pass at least one shape")
        if isinstance(spare, bool) or not isinstance(spare, numbers.Integral) or spare < 0:
            raise ConfigError(f"spare must be an int >= 0 (values after the views), got spare={spare!r}")
        xp = array_api_compat.array_namespace(like) if like is not None else array_api_compat.numpy
        device = array_api_compat.device(like) if like is not None else None
        sizes = [math.prod(s) for s in shapes]
        name = _dtypes.dtype_name(dtype)
        self._storage = xp.zeros(sum(sizes) + int(spare), dtype=_dtypes.resolve(xp, name), device=device)
        self._flat = self._storage[: sum(sizes)] if spare else self._storage
        self._xp, self._shapes, self._dtype_name = xp, tuple(shapes), name
        self._bounds = tuple(zip([0, *accumulate(sizes)], accumulate(sizes)))
        self._views = self.views_of(self._flat)

    def views_of(self, flat: Any) -> tuple[Any, ...]:
        """Views of another flat array of the same length in this layout (e.g. a cast copy)."""
        return tuple(self._xp.reshape(flat[a:b], s) for (a, b), s in zip(self._bounds, self._shapes))

    @property
    def flat(self) -> Any:
        """The one flat array every view shares memory with."""
        return self._flat

    @property
    def storage(self) -> Any:
        """``flat`` followed by the ``spare`` values, in one array (``flat`` itself when none)."""
        return self._storage

    @property
    def views(self) -> tuple[Any, ...]:
        """One view of ``flat`` per shape, in the order of the shapes given."""
        return self._views

    @property
    def shapes(self) -> tuple[tuple[int, ...], ...]:
        """The shapes of the views."""
        return self._shapes

    @property
    def dtype(self) -> str:
        """The dtype name of ``flat`` ("float32", "float16" or "bfloat16")."""
        return self._dtype_name

    def __len__(self) -> int:
        return len(self._views)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({len(self)} arrays, {self._flat.shape[0]} values, dtype={self.dtype}, "
            f"library={type(self._flat).__module__.split('.')[0]})"
        )

    def zero_(self) -> None:
        """Set every array to zero: one fill of ``flat``."""
        self._flat[...] = 0

    def scale_(self, factor: Any) -> None:
        """Multiply every array in place by ``factor`` (a number or a 0-d array): one call."""
        if array_api_compat.is_array_api_obj(factor):
            factor = self._xp.astype(factor, self._flat.dtype)
        self._flat *= factor


def _check_shape(shape: Any) -> tuple[int, ...]:
    try:
        dims = tuple(shape)
    except TypeError:
        dims = None
    if dims is None or not all(isinstance(n, numbers.Integral) and n >= 0 for n in dims):
        raise ConfigError("shapes must be sequences of ints >= 0, got "
                          f"shape={shape!r}; pass e.g. [(3, 4), (4,)]")
    return tuple(int(n) for n in dims)
