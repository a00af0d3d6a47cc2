"""Floating dtypes by name ("float32", "float16", "bfloat16"): one call site for any array library."""

from __future__ import annotations

import functools
from typing import Any

import array_api_compat
import numpy as np

from ._errors import ConfigError, install_hint

COMPUTE_DTYPES = ("float16", "bfloat16", "float32")
#: The floating dtypes, by the last word of ``str(dtype)`` (numpy, torch, paddle, ...).
FLOATING = frozenset(COMPUTE_DTYPES + ("float64",))


def short_name(dtype: Any) -> str:
    """'float32' for any library's float32 ('torch.float32', 'paddle.float32', NumPy's ``>f4``)."""
    if isinstance(dtype, np.dtype):
        return dtype.name
    return str(dtype).rpartition(".")[2]


def dtype_name(dtype: Any, param: str = "dtype") -> str:
    """The name of a floating dtype given as a name, a dtype or a type; ConfigError naming ``param``."""
    original = dtype
    if not isinstance(dtype, str):
        dtype = str(getattr(dtype, "name", None) or getattr(dtype, "__name__", dtype))
    name = dtype.rpartition(".")[2]  # torch.float16, array_api_strict.float32
    if name not in FLOATING:
        raise ConfigError(f"{param} must be one of {list(COMPUTE_DTYPES)} (a name or the library's dtype), "
                          f"got {param}={original!r}")
    return name


def compute_dtype_name(dtype: Any) -> str:
    """Validate a compute dtype: float16, bfloat16 or float32 (float64 is refused)."""
    name = dtype_name(dtype, "compute_dtype")
    if name not in COMPUTE_DTYPES:
        raise ConfigError(f"compute_dtype must be one of {list(COMPUTE_DTYPES)}, got "
                          f"compute_dtype={dtype!r}; mixed precision computes in a lower precision than the "
                          "float32 masters")
    return name


def resolve(xp: Any, name: str) -> Any:
    """The dtype object called ``name`` in namespace ``xp`` (NumPy bfloat16 from ml_dtypes)."""
    found = getattr(xp, name, None)
    if found is not None:
        return found
    if name == "bfloat16" and array_api_compat.is_numpy_namespace(xp):
        return numpy_bfloat16()
    raise ConfigError(f"the array library {getattr(xp, '__name__', xp)!r} has no dtype {name!r}; use "
                      "'float16' or 'float32' with it, or arrays of a library that has it")


def numpy_bfloat16() -> Any:
    """NumPy's bfloat16 (``ml_dtypes.bfloat16``); ImportError saying how to install it."""
    try:
        import ml_dtypes
    except ImportError as exc:
        raise ImportError(f"bfloat16 on NumPy needs ml_dtypes: {install_hint('bfloat16')}") from exc
    return ml_dtypes.bfloat16


def name_of(array: Any) -> str | None:
    """The dtype name of ``array`` if it is one of the known floats, else None."""
    try:
        return dtype_name(array.dtype)
    except ConfigError:
        return None


def cast(array: Any, name: str) -> Any:
    """``array`` as dtype ``name``; the array itself when it already has that dtype."""
    if name_of(array) == name:
        return array
    xp = array_api_compat.array_namespace(array)
    return xp.astype(array, resolve(xp, name))


def is_floating(array: Any) -> bool:
    """Whether ``array`` holds real floating-point values (bfloat16 included)."""
    if name_of(array) is not None:
        return True
    xp = array_api_compat.array_namespace(array)
    return bool(xp.isdtype(array.dtype, "real floating"))


@functools.cache
def computes_float64(xp: Any, device: Any) -> bool:
    """Whether ``device`` of ``xp`` computes in float64 (Apple MPS does not)."""
    try:
        kinds = xp.__array_namespace_info__().dtypes(device=device, kind="real floating")
    except (AttributeError, TypeError, ValueError):  # no inspection API, odd device
        return False
    return "float64" in kinds and getattr(device, "type", None) != "mps"
