"""A third-party array type for the backend-contract test: NumPy values in a box that is NOT an array.

``Boxed`` has no ``__array__``, no DLPack and no array-API namespace, so nothing in polyamp can
handle it except the plugin in ``polyamp_boxed.backend``, which the test registers under the
``polyamp`` entry-point group exactly as a third-party distribution would.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(eq=False)
class Boxed:
    """An array of the test's own: ``data`` holds the values (a NumPy array, kept private)."""

    data: np.ndarray

    @property
    def shape(self) -> tuple[int, ...]:
        return self.data.shape

    @property
    def dtype(self) -> Any:
        return self.data.dtype

    def __float__(self) -> float:  # a 0-d array as a number, as every array library allows
        return float(self.data)

    def __add__(self, number: float) -> Boxed:  # ``scale + 0``: how the engine copies the scale
        return Boxed(self.data + number)


def box(values: Any, dtype: Any = np.float32) -> Boxed:
    """``Boxed(np.array(values, dtype))``."""
    return Boxed(np.array(values, dtype=dtype))
