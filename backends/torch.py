"""PyTorch backend: torch's own fused kernels, grouped per (device, dtype); torch imported lazily.

Nothing here reads a device value back except :func:`read_flag` and :func:`to_host`
(docs/backends/torch.md).
"""

from __future__ import annotations

import functools
import sys
import threading
from collections.abc import Callable, Sequence
from operator import attrgetter
from typing import Any

import numpy as np

from polyamp._errors import install_hint
from polyamp._hookspecs import hookimpl
from polyamp._inputs import refuse_meta
from polyamp.config import SCALE_FLOOR
from polyamp.policy import LossScaleState, next_state

_CASTS = ("float32", "float16", "bfloat16", "float64")
_TORCH_MODULE: Any = None  # torch once imported: callers read it first, a global read per call


def _torch() -> Any:
    """torch, imported at the first call (never at plugin load)."""
    global _TORCH_MODULE
    import torch

    _TORCH_MODULE = torch
    return torch


@hookimpl
def backend_info() -> dict[str, Any]:
    try:
        torch = _TORCH_MODULE or _torch()  # a global read after the first call
    except ImportError as exc:
        return {"available": False, "reason": f"torch is not installed ({exc}). Fix: {install_hint('torch')}",
                "version": None}
    return {"available": True, "reason": "", "version": torch.__version__}


@hookimpl
def owns_array(array: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(array, torch.Tensor)


@hookimpl
def full(value: Any, dtype: str, like: Any) -> Any:
    torch = _TORCH_MODULE or _torch()  # a global read after the first call
    kind = getattr(torch, dtype)
    if like is None:
        return torch.full((), value, dtype=kind)
    if type(like) is torch.Tensor and like.layout is torch.strided:
        return like.new_full((), value, dtype=kind)  # the hot path: cheaper than device=
    return torch.full((), value, dtype=kind, device=like.device)


@hookimpl
def scale_array(array: Any, scale: Any) -> Any:
    return array * scale.to(device=array.device, non_blocking=True)


def group_by_device_and_dtype(tensors: list[Any]) -> list[tuple[Any, list[Any]]]:
    """``[(device, tensors)]``: one list per (device, dtype), in order; one C++ pass (torch's foreach
    optimizers' grouping)."""
    torch = _TORCH_MODULE or _torch()  # a global read after the first call
    grouped = torch._C._group_tensors_by_device_and_dtype([tensors], False)
    return [(device, lists[0]) for (device, _), (lists, _) in grouped.items()]


_IS_SPARSE = attrgetter("is_sparse")


def _dense(grads: Sequence[Any]) -> list[Any]:
    """Sparse gradients replaced by their values (unscaled in place, as torch does)."""
    if any(map(_IS_SPARSE, grads)):  # the per-gradient loop in C
        return [g._values() if g.is_sparse else g for g in grads]
    return grads if isinstance(grads, list) else list(grads)


def inverse_scale(scale: Any) -> Any:
    """float32(1 / float64(scale)), bit for bit what torch's GradScaler computes: on CPU (and MPS, as
    torch) one float32 division gives the same bits (correctly rounded; 53 >= 2*24 + 2), two kernels
    fewer per step; elsewhere float64, as float32 division can be imprecise under some compile options."""
    if scale.is_cpu or scale.is_mps:
        return scale.reciprocal()
    return scale.double().reciprocal_().float()


@hookimpl
def unscale_and_check(grads: Sequence[Any], scale: Any, found_inf: Any) -> None:
    """One fused torch kernel per (device, dtype) group; other devices' flags copied to ``found_inf``'s
    device asynchronously (no host sync)."""
    if not grads:
        return
    torch = _TORCH_MODULE or _torch()  # a global read after the first call
    inv_scale = inverse_scale(scale)
    home = found_inf.device
    grad_mode = torch.is_grad_enabled()
    torch._C._set_grad_enabled(False)  # torch.no_grad() without the context-manager cost
    try:
        groups = group_by_device_and_dtype(_dense(grads))
        on_home = len(groups) == 1 and groups[0][0] == home  # the usual case: the state's device
        if not on_home and any(device.type == "meta" for device, _ in groups):  # before any kernel
            refuse_meta(grads, "unscale_()/step()")
        for device, group in groups:
            if device == home:
                torch._amp_foreach_non_finite_check_and_unscale_(group, found_inf, inv_scale)
                continue
            flag = torch.zeros((), dtype=torch.float32, device=device)
            inv = inv_scale.to(device, non_blocking=True)
            torch._amp_foreach_non_finite_check_and_unscale_(group, flag, inv)
            torch.maximum(found_inf, flag.to(home, non_blocking=True), out=found_inf)
    finally:
        torch._C._set_grad_enabled(grad_mode)


@hookimpl
def unscale_and_squares(grads: Sequence[Any], scale: Any, found_inf: Any) -> Any:
    """Unscale and a StepGuard's sum of squares: float32 CPU gradients in ONE pass (the NumPy backend's
    compiled kernel on their memory: torch's float32 products, bit for bit); else the two passes."""
    from . import _numpy_squares

    torch = _TORCH_MODULE or _torch()  # a global read after the first call
    views = _cpu_views(torch, grads, found_inf, (torch.float32,), _numpy_squares, torch.Tensor.numpy)
    if views is not None:
        inv = np.float32(inverse_scale(scale).item())  # a CPU scalar: no sync
        return torch.from_numpy(_numpy_squares.unscale_and_squares(views, inv, found_inf.numpy()))
    unscale_and_check(grads, scale, found_inf)
    return sum_of_squares(grads)


@hookimpl
def unscale_and_count(grads: Sequence[Any], scale: Any, found_inf: Any, bounds: Sequence[Any]) -> Any:
    """Unscale and a meter's precision counts: float32/float64/float16 CPU gradients in ONE pass (the
    NumPy backend's compiled kernel through DLPack), CUDA ones by the cupy backend's fused kernel
    where cupy runs; else torch's unscale, then the counts' array-API passes."""
    from . import _numpy_counts

    torch = _TORCH_MODULE or _torch()  # a global read after the first call
    dtypes = (torch.float32, torch.float64, torch.float16)
    views = (_cpu_views(torch, grads, found_inf, dtypes, _numpy_counts, np.from_dlpack)  # no host read
             if scale.device.type == "cpu" else None)
    if views is not None:
        host_scale = np.from_dlpack(scale.detach()).reshape(())  # CPU memory: no sync
        inv = np.float32(1.0 / np.float64(host_scale))
        counts, extremes = _numpy_counts.unscale_and_count(views, inv, float(host_scale),
                                                           np.from_dlpack(found_inf), bounds)
        return torch.from_numpy(counts), torch.from_numpy(extremes)
    if _on_cupy(grads, scale, found_inf):
        return _cupy_counts(torch, grads, scale, found_inf, bounds)
    from .array_api import precision_counts

    unscale_and_check(grads, scale, found_inf)
    return precision_counts(grads, scale, bounds)


def _on_cupy(grads: Sequence[Any], scale: Any, found_inf: Any) -> bool:
    """Whether the cupy backend's fused kernel takes these gradients: dense CUDA tensors of its
    dtypes on the flag's device, and cupy with a device and NVRTC here (asked once)."""
    device = found_inf.device
    return device.type == "cuda" and scale.device == device and bool(grads) and not any(
        g.device != device or g.is_sparse or str(g.dtype).rpartition(".")[2] not in _CUPY_DTYPES
        for g in grads) and _cupy_runs()


_CUPY_DTYPES = ("float32", "float64", "float16", "bfloat16")


@functools.cache
def _cupy_runs() -> bool:
    """Whether the cupy backend runs here (asked once, at the first CUDA sample step)."""
    from . import cupy as plugin

    try:
        return bool(plugin.backend_info()["available"])
    except Exception:  # noqa: BLE001 - a broken cupy install: torch's own passes
        return False


def _cupy_counts(torch: Any, grads: Sequence[Any], scale: Any, found_inf: Any, bounds: Sequence[Any]) -> Any:
    """The cupy backend's fused kernel on torch's CUDA tensors and current stream; no host read."""
    import cupy

    from . import _cupy_launch

    stream = torch.cuda.current_stream(found_inf.device)
    with cupy.cuda.Device(found_inf.device.index), cupy.cuda.ExternalStream(stream.cuda_stream):
        counts, extremes = _cupy_launch.unscale_and_count(
            list(grads), _cupy_launch.as_cupy(scale), _cupy_launch.as_cupy(found_inf), bounds)
    return torch.from_dlpack(counts), torch.from_dlpack(extremes)


def _cpu_views(torch: Any, grads: Sequence[Any], found_inf: Any, dtypes: tuple[Any, ...], kernels: Any,
               view: Callable[[Any], Any]) -> list[Any] | None:
    """NumPy ``view``s of plain, contiguous CPU gradients of ``dtypes`` when ``kernels``' compiled fused
    kernel runs here, else None (other dtypes, devices, layouts or tensor subclasses: torch's passes)."""
    if not grads or found_inf.device.type != "cpu" or not kernels.fused_available() or any(
            type(g) is not torch.Tensor or g.dtype not in dtypes or g.device.type != "cpu"
            or g.layout != torch.strided or not g.is_contiguous() for g in grads):
        return None
    return [view(g.detach()) for g in grads]


#: Values squared at a time into a reused scratch buffer (4 MiB of float32 per device and dtype).
_SQUARES_CHUNK = 2**20
_scratch = threading.local()  # per thread: (device, dtype) -> the scratch buffer of the guard's squares


@hookimpl
def sum_of_squares(arrays: Sequence[Any]) -> Any:
    """Each chunk of 2**20 values squared in its dtype (16-bit ones in float32) into a reused buffer and
    summed there, the chunks' sums added in float64: about 2**-24 relative, no allocation per step. A
    chunk whose float32 sum passes float32's max gives inf (a norm of ~1.8e19 and more: a spike)."""
    torch = _TORCH_MODULE or _torch()  # a global read after the first call
    buffers = vars(_scratch).setdefault("buffers", {})  # this thread's: threads never share one
    parts = []
    for g in arrays:
        flat = g.detach().reshape(-1)
        if flat.dtype not in (torch.float32, torch.float64):
            flat = flat.float()
        key = (flat.device, flat.dtype)
        scratch = buffers.get(key)
        if scratch is None:
            scratch = buffers[key] = torch.empty(_SQUARES_CHUNK, dtype=flat.dtype, device=flat.device)
        for start in range(0, flat.numel(), _SQUARES_CHUNK):
            chunk = flat[start:start + _SQUARES_CHUNK]
            out = scratch[:chunk.numel()]
            torch.mul(chunk, chunk, out=out)
            parts.append(out.sum().to(torch.float64))
    if not parts:
        return torch.zeros((), dtype=torch.float64, device=arrays[0].device)
    return torch.stack(parts).sum()


@hookimpl
def all_finite(arrays: Sequence[Any]) -> Any:
    torch = _TORCH_MODULE or _torch()  # a global read after the first call
    if not arrays:
        return torch.tensor(True)
    home = arrays[0].device
    flags = [torch.isfinite(a).all().to(home, non_blocking=True) for a in arrays]
    return torch.stack(flags).all()


@hookimpl
def cast(array: Any, dtype: str) -> Any:
    torch = _TORCH_MODULE or _torch()  # a global read after the first call
    if dtype not in _CASTS:
        raise ValueError(f"dtype must be one of {', '.join(map(repr, _CASTS))}, got dtype={dtype!r}")
    return array.to(getattr(torch, dtype))


def _torch_rule(config: Any) -> bool:
    """Whether torch's own fused update implements ``config`` exactly."""
    return (config.dynamic and config.backoff_interval == 1 and config.min_scale is None
            and config.max_scale is None and config.rule == "torch"
            and config.product_dtype in (None, "float64"))  # torch's own products


@hookimpl
def update_scale(state: Any, found_inf: Any, config: Any) -> Any:
    """torch's fused ``_amp_update_scale_`` for torch's rule, else the rule as tensor ops; in place, no
    host read. torch's ``==`` is the rule's ``>=`` within :func:`polyamp.policy.tracker_limits`, where
    the engine keeps the state (a tracker past the interval would never grow here)."""
    scale, growth, backoff = state
    if _torch_rule(config):
        torch = _TORCH_MODULE or _torch()
        torch._amp_update_scale_(scale, growth, found_inf, config.growth_factor, config.backoff_factor,
                                 config.growth_interval)
        # torch backs off down to 0; stop at the floor (a no-op for every scale torch keeps: bitwise torch's)
        torch.clamp_min_(scale, SCALE_FLOOR)  # the cheapest form: 0.8 us, not 1.1
        return state
    if not config.dynamic:
        return state
    import array_api_compat.torch as xp

    for old, new in zip(state, next_state(LossScaleState(scale, growth, backoff), found_inf, config, xp)):
        old.copy_(new)
    return state


@hookimpl
def read_flag(found_inf: Any) -> bool:
    return found_inf.item() != 0


@hookimpl
def to_host(array: Any) -> float | int:
    return array.item()


# -- what the core needs beside the kernels ------------------------------------------------
@hookimpl
def is_host(array: Any) -> bool:
    return array.is_cpu  # a plain attribute read


@hookimpl
def host_view(array: Any) -> Any:
    """``Tensor.numpy()`` of a CPU tensor (shares its memory; cheaper than DLPack), else None."""
    if not array.is_cpu:
        return None
    try:
        return array.numpy()
    except (RuntimeError, TypeError):  # requires grad, bfloat16, conjugate or negative bits
        return None


@hookimpl
def to_numpy(array: Any) -> Any:
    """A CPU tensor's memory as NumPy (no copy), else one device-to-host copy; bfloat16 as float32."""
    array = array.detach()
    if array.dtype is (_TORCH_MODULE or _torch()).bfloat16:
        array = array.float()
    return array.cpu().numpy()


@hookimpl
def from_host(values: Any, like: Any, dtype: Any) -> Any:
    torch = _TORCH_MODULE or _torch()  # a global read after the first call
    if values.ndim == 0:  # a flag: from the Python number, the cheapest way torch makes one
        kind = getattr(torch, values.dtype.name) if dtype is None else dtype
        return torch.tensor(values.item(), dtype=kind, device=like.device)
    return torch.tensor(values, dtype=dtype, device=like.device)


def _finite_by_extremes(tensors: list[Any]) -> Any:
    """One aminmax pass per tensor (nan propagates; many times faster than isfinite on CPU),
    then one stack of all the extremes (promoted to a common dtype) and one isfinite."""
    torch = _TORCH_MODULE or _torch()  # a global read after the first call
    extremes = torch.stack([v for t in tensors for v in t.detach().aminmax()])
    return torch.isfinite(extremes).view(-1, 2).all(1)


@hookimpl
def finite_flags(arrays: Sequence[Any]) -> list[bool]:
    from polyamp.backends.array_api import read_flags

    return read_flags(arrays, lambda t: t.device, _finite_by_extremes, lambda flags: flags.cpu())


@hookimpl
def model_steps(model: Any, dtype: str) -> Any:
    """An ``nn.Module`` runs under ``torch.autocast`` (polyamp._trainer_torch)."""
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(model, torch.nn.Module):
        return None
    from polyamp._trainer_torch import TorchSteps

    return TorchSteps(model, dtype)
