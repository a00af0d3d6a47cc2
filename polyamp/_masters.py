"""The check both halves of MixedPrecisionTrainer share (``trainer``, ``_trainer_torch``): the
model's parameters are float32 masters."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from . import _dtypes
from ._errors import ConfigError

__all__ = ["check_masters"]


def check_masters(params: list[Any], kind: type, data_of: Callable[[Any], Any]) -> None:
    """Raise unless every parameter is a ``kind`` holding float32 values (the masters)."""
    if not params:
        raise ConfigError("the model has no parameters to train; model.parameters() returned none")
    for i, p in enumerate(params):
        if not isinstance(p, kind):
            raise TypeError(f"model.parameters()[{i}] is a {type(p).__qualname__}, expected "
                            f"{kind.__qualname__}; wrap master arrays as polyamp.Parameter(array)")
        if _dtypes.name_of(data_of(p)) != "float32":
            raise ConfigError(f"master weights must be float32, but model.parameters()[{i}] has dtype "
                              f"{data_of(p).dtype}; keep float32 masters (the trainer casts to the compute "
                              "dtype)")
