"""CuPy backend: fused multi-tensor CUDA kernels, compiled by NVRTC on first use; lazy cupy import.

``unscale_and_check`` is one launch per dtype for any number of gradients (bitwise as torch's);
``update_scale`` runs ``polyamp.policy``'s rule in a one-thread kernel; only ``read_flag`` and
``to_host`` sync. Once chosen, it also takes foreign CUDA arrays through zero-copy views, on cupy's
current stream (docs/backends/cupy.md: foreign arrays, streams, bfloat16).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

from polyamp._errors import install_hint
from polyamp._hookspecs import hookimpl
from polyamp.policy import LossScaleState

from . import _cupy_launch
from ._scaling import scale_in_own_dtype

_FLOAT_DTYPES = ("float32", "float16", "bfloat16", "float64")


def _cupy() -> Any:
    import cupy

    return cupy


def _unavailable(reason: str, version: str | None = None) -> dict[str, Any]:
    return {"available": False, "reason": reason, "version": version}


@hookimpl
def backend_info() -> dict[str, Any]:
    try:
        cupy = _cupy()
    except ImportError as exc:
        return _unavailable(
            f"cupy is not installed ({exc}). Fix: {install_hint('cupy')} "
            "(or the cupy-cudaXXx wheel matching your CUDA)"
        )
    except Exception as exc:  # a broken install must not break discovery
        return _unavailable(f"cupy is installed but failed to import: {type(exc).__name__}: {exc}")
    version = cupy.__version__
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:
        return _unavailable(f"cupy {version} is installed but no CUDA device is available: {exc}", version)
    if count < 1:
        return _unavailable(f"cupy {version} is installed but found 0 CUDA devices", version)
    try:
        from cupy_backends.cuda.libs import nvrtc

        nvrtc.getVersion()
    except Exception as exc:
        return _unavailable(
            f"cupy {version} sees {count} CUDA device(s) but cannot load NVRTC, which compiles "
            f"polyamp's kernels: {exc}. Fix: install the CUDA toolkit or NVRTC for your cupy build",
            version,
        )
    return {"available": True, "reason": "", "version": version}


@hookimpl
def owns_array(array: Any) -> bool:
    cupy = sys.modules.get("cupy")
    return cupy is not None and isinstance(array, cupy.ndarray)


@hookimpl
def accepts_array(array: Any) -> bool:
    return owns_array(array) or _cupy_launch.is_cuda_array(array)


def _device_of(like: Any) -> int | None:
    if like is None:
        return None
    if owns_array(like):
        return like.device.id
    if hasattr(like, "__dlpack_device__") and _cupy_launch.is_cuda_array(like):
        return int(like.__dlpack_device__()[1])
    if _cupy_launch.is_cuda_array(like):
        return _cupy_launch.as_cupy(like).device.id
    raise TypeError(
        f"the cupy backend keeps state on a CUDA device, got like={type(like).__name__} "
        "that is not in CUDA memory. Fix: pass cupy arrays or CUDA tensors."
    )


@hookimpl
def full(value: Any, dtype: str, like: Any) -> Any:
    cupy = _cupy()
    device = _device_of(like)
    with cupy.cuda.Device(device):  # None: the current device
        return cupy.full((), value, dtype=getattr(cupy, dtype))


@hookimpl
def scale_array(array: Any, scale: Any) -> Any:
    if not owns_array(array):  # a foreign CUDA array: scale in its own library (keeps autograd)
        import array_api_compat

        return array * array_api_compat.array_namespace(array).from_dlpack(scale)
    cupy = _cupy()
    return scale_in_own_dtype(array, scale, str(array.dtype),
                              lambda a, s: cupy.multiply(a, s, dtype=cupy.float32))


@hookimpl
def unscale_and_check(grads: Sequence[Any], scale: Any, found_inf: Any) -> None:
    _cupy_launch.unscale_and_check(grads, scale, found_inf, check_only=False)


unscale_and_count = hookimpl(_cupy_launch.unscale_and_count)  # unscaled and counted in one pass
all_finite = hookimpl(_cupy_launch.all_finite)


def bfloat16_dtype() -> Any:
    """ml_dtypes.bfloat16 when this cupy can hold it (cupy >= 14), else a clear error."""
    cupy = _cupy()
    major = int(cupy.__version__.split(".")[0])
    try:
        import ml_dtypes
    except ImportError:
        ml_dtypes = None
    if major < 14 or ml_dtypes is None:
        raise TypeError(
            f"cupy {cupy.__version__} cannot hold bfloat16 arrays (needs cupy >= 14 and "
            f"ml_dtypes{'' if ml_dtypes else ', which is not installed'}). Fix: pip install "
            "'cupy-cuda12x>=14' ml_dtypes, or cast to 'float16'."
        )
    return ml_dtypes.bfloat16


@hookimpl
def cast(array: Any, dtype: str) -> Any:
    if dtype not in _FLOAT_DTYPES:
        raise ValueError(f"dtype must be 'float32', 'float16' or 'bfloat16', got dtype={dtype!r}")
    if not owns_array(array):  # a foreign CUDA array: a new array of its own library
        import array_api_compat

        xp = array_api_compat.array_namespace(array)
        return xp.astype(array, getattr(xp, dtype))
    cupy = _cupy()
    return array.astype(bfloat16_dtype() if dtype == "bfloat16" else getattr(cupy, dtype))


@hookimpl
def update_scale(state: Any, found_inf: Any, config: Any) -> Any:
    if not config.dynamic:
        return state
    scale, growth, backoff = state
    _cupy_launch.update_scale(scale, growth, backoff, _cupy_launch.as_cupy(found_inf), config)
    return LossScaleState(scale, growth, backoff)


@hookimpl
def read_flag(found_inf: Any) -> bool:
    return bool(found_inf.item() != 0)


@hookimpl
def to_host(array: Any) -> float | int:
    return array.item()


# -- what the core needs beside the kernels: cupy arrays live in device memory --------------
@hookimpl
def is_host(array: Any) -> bool:
    return False


@hookimpl
def host_view(array: Any) -> Any:
    return None


@hookimpl
def to_numpy(array: Any) -> Any:
    """One device-to-host copy (a sync)."""
    return _cupy_launch.as_cupy(array).get()


@hookimpl
def from_host(values: Any, like: Any, dtype: Any) -> Any:
    cupy = _cupy()
    with cupy.cuda.Device(_device_of(like)):
        return cupy.array(values, dtype=dtype)
