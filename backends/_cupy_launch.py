"""Launching the cupy backend's kernels: gradients to device views, chunk-table plans, caches.

A plan holds per dtype a device chunk table, the tensor and chunk counts and the grid. Plans are
cached by the identity of a list of cupy arrays (a live cupy array's pointer, size and dtype never
change) and by (dtype, pointer, size) of every gradient; foreign CUDA arrays become zero-copy cupy
views on every call, since their storage can be swapped in place (docs/backends/cupy.md). Kernels
run on cupy's current stream; nothing here reads device memory on the host.
"""

from __future__ import annotations

import functools
import sys
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from polyamp.policy import rule_params

from . import _cupy_kernels as kern
from ._cupy_kernels import BLOCK_THREADS, CHUNK, build_table, kernel

INT32_MAX = 2**31 - 1
_DLPACK_CUDA_DEVICES = (2, 13)  # kDLCUDA, kDLCUDAManaged


class Launch(NamedTuple):
    """One kernel launch: all gradients of one dtype."""

    kind: str
    table: Any
    n_tensors: int
    n_chunks: int
    grid: int


class Plan(NamedTuple):
    """Every launch for one gradient list, all on one device."""

    device: int
    launches: tuple[Launch, ...]


def dtype_kind(dtype: Any) -> str | None:
    """"float32", "float64", "float16" or "bfloat16" for a numpy/cupy/torch dtype, else None."""
    name = str(dtype).rsplit(".", 1)[-1]
    return name if name in kern.UNSCALE_KERNELS else None


def is_cuda_array(array: Any) -> bool:
    """Whether ``array`` is a foreign array in CUDA device memory (checked without imports)."""
    try:
        if hasattr(array, "__dlpack_device__"):
            return array.__dlpack_device__()[0] in _DLPACK_CUDA_DEVICES
        return hasattr(array, "__cuda_array_interface__")
    except Exception:  # an odd object must read as "not ours", never raise
        return False


def group_by_kind(entries: Sequence[tuple[str, int, int]]) -> dict[str, tuple[list, list]]:
    """Pointers and sizes per dtype, in first-seen order, from ``(kind, ptr, size)`` entries."""
    groups: dict[str, tuple[list, list]] = {}
    for kind, ptr, size in entries:
        ptrs, sizes = groups.setdefault(kind, ([], []))
        ptrs.append(ptr)
        sizes.append(size)
    return groups


class _IdentityPlans:
    """Plans keyed by the ids of a list of cupy arrays; an entry dies with any of its arrays."""

    def __init__(self, capacity: int = 8) -> None:
        self._capacity = capacity
        self._entries: OrderedDict[tuple[int, ...], tuple[Plan, list[Any]]] = OrderedDict()

    def get(self, key: tuple[int, ...]) -> Plan | None:
        entry = self._entries.get(key)
        return None if entry is None else entry[0]

    def put(self, key: tuple[int, ...], arrays: Sequence[Any], plan: Plan) -> None:
        def drop(_ref: Any, key: tuple[int, ...] = key) -> None:
            self._entries.pop(key, None)

        self._entries[key] = (plan, [weakref.ref(a, drop) for a in arrays])
        while len(self._entries) > self._capacity:
            self._entries.popitem(last=False)


_by_identity = _IdentityPlans()
_sm_counts: dict[int, int] = {}
_ones: dict[int, Any] = {}


def as_cupy(array: Any, position: int = 0) -> Any:
    """A cupy array for ``array``: itself, or a zero-copy view of a foreign CUDA array."""
    import cupy

    if isinstance(array, cupy.ndarray):
        return array
    if not is_cuda_array(array):
        raise TypeError(
            f"gradient {position} is a {type(array).__module__}.{type(array).__name__} that is "
            "not in CUDA device memory; the cupy backend needs cupy arrays or CUDA arrays "
            "exposing __dlpack__ / __cuda_array_interface__. Fix: move it to the GPU, or "
            "choose the backend of its library."
        )
    if getattr(array, "requires_grad", False):
        array = array.detach()  # shares storage: in-place work still reaches the original
    if not hasattr(array, "__dlpack__"):
        return cupy.asarray(array)  # __cuda_array_interface__: zero-copy
    try:
        return cupy.from_dlpack(array)  # zero-copy; orders the producer's stream before ours
    except (TypeError, ValueError, BufferError, RuntimeError):
        if dtype_kind(array.dtype) != "bfloat16" or "torch" not in sys.modules:
            raise
        # cupy without a bfloat16 dtype: borrow the bits as int16; kind comes from the tensor.
        return cupy.from_dlpack(array.view(sys.modules["torch"].int16))


def _views(arrays: Sequence[Any]) -> tuple[list[tuple[Any, str]], list[tuple[Any, Any]], bool]:
    """(view, kind) per array, (contiguous copy, strided view) pairs, and cacheable-by-identity."""
    import cupy

    views, copies, cacheable = [], [], True
    for position, array in enumerate(arrays):
        kind = dtype_kind(array.dtype)
        if kind is None:
            raise TypeError(
                f"gradient {position} has dtype {array.dtype}; unscaling needs float16, "
                "bfloat16, float32 or float64 gradients. Fix: leave non-float arrays out."
            )
        view = as_cupy(array, position)
        cacheable = cacheable and view is array
        if not (view.flags.c_contiguous or view.flags.f_contiguous):
            tmp = cupy.ascontiguousarray(view)
            copies.append((tmp, view))
            view, cacheable = tmp, False
        views.append((view, kind))
    return views, copies, cacheable


def _plan(views: list[tuple[Any, str]]) -> Plan:
    """The plan for these views, from the pointer cache or built (one small host-to-device copy)."""
    devices = {view.device.id for view, _ in views}
    if len(devices) > 1:
        raise ValueError(
            f"the cupy backend unscales gradients on one CUDA device per scaler; got devices "
            f"{sorted(devices)}. Fix: use one scaler per device, or backend='torch' for "
            "model-parallel torch code."
        )
    return _build_plan(devices.pop(), tuple((kind, view.data.ptr, view.size) for view, kind in views))


@functools.lru_cache(maxsize=8)  # by (dtype, pointer, size) of every gradient
def _build_plan(device: int, entries: tuple[tuple[str, int, int], ...]) -> Plan:
    import cupy

    if device not in _sm_counts:
        _sm_counts[device] = cupy.cuda.Device(device).attributes["MultiProcessorCount"]
    launches = []
    with cupy.cuda.Device(device):
        for kind, (ptrs, sizes) in group_by_kind(entries).items():
            host_table, n_chunks = build_table(ptrs, sizes, CHUNK)
            if n_chunks:
                grid = min(n_chunks, _sm_counts[device] * kern.MAX_BLOCKS_PER_SM)
                table = cupy.asarray(host_table)
                launches.append(Launch(kind, table, len(ptrs), n_chunks, grid))
    return Plan(device, tuple(launches))


def _check_same_device(plan: Plan, scale: Any, found_inf: Any) -> None:
    for name, array in (("scale", scale), ("found_inf", found_inf)):
        if array.device.id != plan.device:
            raise ValueError(
                f"the scaler's {name} lives on CUDA device {array.device.id} but the gradients "
                f"on device {plan.device}. Fix: use one scaler per device."
            )


def unscale_and_check(grads: Sequence[Any], scale: Any, found_inf: Any, check_only: bool) -> None:
    """Unscale (or only check, when ``check_only``) ``grads``: one launch per dtype, no sync."""
    if not grads:
        return
    import cupy

    key = tuple(map(id, grads))
    plan, copies = _by_identity.get(key), []
    if plan is None:
        views, copies, cacheable = _views(grads)
        plan = _plan(views)
        if cacheable:
            _by_identity.put(key, grads, plan)
    _check_same_device(plan, scale, found_inf)
    with cupy.cuda.Device(plan.device):
        for launch in plan.launches:
            kernel(kern.UNSCALE_KERNELS[launch.kind], plan.device)((launch.grid,), (BLOCK_THREADS,), (
                launch.table, np.int32(launch.n_tensors), np.int64(launch.n_chunks), np.int32(CHUNK),
                scale, found_inf, np.int32(check_only),
            ))
    if not check_only:
        for tmp, strided in copies:
            strided[...] = tmp


def target_table(bounds: Sequence[Any]) -> np.ndarray:
    """The count kernels' ``targets`` (``_cupy_kernels.TARGET_SLOTS`` per target) from
    ``polyamp._precision_targets.Bounds``."""
    kinds = {"loss": 0.0, "amax": 2.0}
    rows = [[kinds.get(b.scale, 1.0), 0.0 if b.scale in kinds else float(b.scale), b.underflow_max,
             b.subnormal_below, b.overflow_from, b.max_finite] for b in bounds]
    return np.asarray(rows, np.float64).reshape(-1)


def empty_counts(xp: Any, tensors: int, targets: int) -> tuple[Any, Any]:
    """Zeroed ``raw`` (uint64, one row per tensor) and ``extremes`` (amax bits 0, amin bits +inf)
    for the count kernels, in namespace ``xp`` (cupy; NumPy for the host emulation)."""
    raw = xp.zeros((tensors, kern.RAW_FIELDS + 3 * targets), dtype=xp.uint64)
    extremes = xp.zeros((tensors, 2), dtype=xp.uint64)
    extremes[:, 1] = kern.INF_BITS
    return raw, extremes


def finish_counts(xp: Any, raw: Any, extremes: Any, sizes: Any, targets: int) -> tuple[Any, Any]:
    """``(counts, extremes)`` as ``polyamp._precision_counts.count`` lays them out, from the kernels'
    ``raw`` and ``extremes`` and the tensors' ``sizes`` (int64), by array operations (no host read)."""
    raw = raw.view(xp.int64)
    nonfinite, zeros = raw[:, 0], raw[:, 1]
    columns = [sizes, zeros, nonfinite]
    for j in range(targets):
        low, below, over = (raw[:, kern.RAW_FIELDS + 3 * j + k] for k in range(3))
        columns += [low - zeros - nonfinite, below - low, over]
    wide = extremes.view(xp.float64)
    return xp.stack(columns, axis=1).reshape(-1), xp.concatenate([wide[:, 0], -wide[:, 1]])


def unscale_and_count(grads: Sequence[Any], scale: Any, found_inf: Any,
                      bounds: Sequence[Any]) -> tuple[Any, Any]:
    """Unscale ``grads`` and count them for a precision meter: one launch per dtype (two with an
    ``"amax"`` target), ``(counts, extremes)`` on their device, no sync."""
    import cupy

    views, copies, _ = _views(grads)
    plan = _plan(views)
    _check_same_device(plan, scale, found_inf)
    n, targets = len(views), len(bounds)
    phases = (0, 1) if any(b.scale == "amax" for b in bounds) else (0,)
    positions: dict[str, list[int]] = {}
    for i, (_, kind) in enumerate(views):
        positions.setdefault(kind, []).append(i)
    with cupy.cuda.Device(plan.device):
        table = cupy.asarray(target_table(bounds))
        raw, extremes = empty_counts(cupy, n, targets)
        for launch in plan.launches:
            where = positions[launch.kind]
            part_raw, part_extremes = empty_counts(cupy, len(where), targets)
            fn = kernel(kern.COUNT_KERNELS[launch.kind], plan.device)
            for phase in phases:
                fn((launch.grid,), (BLOCK_THREADS,), (
                    launch.table, np.int32(launch.n_tensors), np.int64(launch.n_chunks), np.int32(CHUNK),
                    scale, found_inf, table, np.int32(targets), np.int32(phase), part_raw, part_extremes,
                ))
            index = cupy.asarray(np.asarray(where, np.int64))
            raw[index], extremes[index] = part_raw, part_extremes
        for tmp, strided in copies:
            strided[...] = tmp
        sizes = cupy.asarray(np.asarray([v.size for v, _ in views], np.int64))
        return finish_counts(cupy, raw, extremes, sizes, targets)


def all_finite(arrays: Sequence[Any]) -> Any:
    """A 0-d cupy bool: True when every value is finite; one read-only launch per dtype."""
    import cupy

    if not arrays:
        return cupy.asarray(True)
    device = as_cupy(arrays[0]).device.id
    with cupy.cuda.Device(device):
        flag = cupy.zeros((), dtype=cupy.float32)
        if device not in _ones:
            _ones[device] = cupy.ones((), dtype=cupy.float32)
        unscale_and_check(arrays, _ones[device], flag, check_only=True)
        return flag == 0


def update_flags(config: Any) -> int:
    """The update kernel's ``flags``: bounds, product precision and the rule's parameters."""
    params = rule_params(config)
    bits = ((kern.HAS_MIN, config.min_scale is not None), (kern.HAS_MAX, config.max_scale is not None),
            (kern.FLOAT32_PRODUCT, config.products == "float32"), (kern.KEEPS_COUNT, params.keeps_count),
            (kern.FINITE_REFILLS, params.finite_refills), (kern.GROWTH_DELAY, params.growth_delay))
    return sum(bit for bit, on in bits if on)


def update_scale(scale: Any, growth: Any, backoff: Any, found_inf: Any, config: Any) -> None:
    """Run ``polyamp.policy``'s rule in place on the device: one single-thread launch."""
    import cupy

    for name, value in (("growth_interval", config.growth_interval),
                        ("backoff_interval", config.backoff_interval)):
        if value > INT32_MAX:
            raise ValueError(
                f"the cupy backend keeps trackers in int32, so {name} must be <= {INT32_MAX}, "
                f"got {name}={value}. Fix: use a smaller interval."
            )
    if found_inf.dtype != cupy.float32:
        found_inf = found_inf.astype(cupy.float32)
    flags = update_flags(config)
    device = scale.device.id
    with cupy.cuda.Device(device):
        kernel(kern.UPDATE_KERNEL, device)((1,), (1,), (
            scale, growth, backoff, found_inf,
            np.float64(config.growth_factor), np.float64(config.backoff_factor),
            np.int32(config.growth_interval), np.int32(config.backoff_interval),
            np.float32(config.min_scale or 0.0), np.float32(config.max_scale or 0.0),
            np.int32(flags),
        ))
