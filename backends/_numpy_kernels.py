"""NumPy fused unscale-and-check, as torch's ``_amp_foreach_non_finite_check_and_unscale_``.

Three interchangeable paths give bit-identical gradients and the same flag (docs/backends/numpy.md):
``compiled`` (one numba loop per gradient, compiled lazily and cached on disk; float16 and bfloat16
multiplied in float32 and rounded back to nearest-even, as torch does), ``blocked`` (NumPy over
cache-sized blocks: one trip through memory) and ``naive`` (``isfinite`` then ``*=``). The path is
``set_kernel(name)``, else ``$POLYAMP_NUMPY_KERNEL``, else ``compiled`` (``blocked`` without numba).
A gradient of at least ``2 * PARALLEL_BYTES`` is cut across ``threads()`` threads, as torch's kernel
runs on its intra-op threads. Importing this module imports only NumPy.
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from concurrent.futures import ThreadPoolExecutor

__all__ = ["ENV_VAR", "KERNELS", "THREADS_ENV_VAR", "active_kernel", "all_finite", "compiled_available",
           "set_kernel", "set_threads", "threads", "unscale_and_check_"]

ENV_VAR = "POLYAMP_NUMPY_KERNEL"
THREADS_ENV_VAR = "POLYAMP_NUMPY_THREADS"
KERNELS = ("compiled", "blocked", "naive")
#: Bytes per block of the blocked path: the check and the multiply of a block hit L2, not DRAM.
BLOCK_BYTES = 512 * 1024
#: Least bytes per thread: below this, handing a part to a thread costs more than it saves.
PARALLEL_BYTES = 4 * 1024 * 1024

#: Why the compiled path is unavailable (``None`` while it works or has not been tried yet).
compiled_error: str | None = None

_forced: str | None = None
_forced_threads: int | None = None
_compiled: dict[str, Callable[..., bool]] | None = None
#: The numba kernels themselves by dtype name (16-bit ones take uint16 views), for ``_numpy_counts``.
dispatchers: dict[str, Any] = {}
_compile_tried = False
_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None  # concurrent.futures is imported with the first pool
_pool_key: tuple[int, int] = (0, 0)  # (pid, workers) the pool was made for: a forked child makes its own

# Exponent mask per dtype name: a value is inf/nan exactly when all its exponent bits are set.
_EXP_MASK = {"float16": 0x7C00, "bfloat16": 0x7F80, "float32": 0x7F800000, "float64": 0x7FF0000000000000}
_F16_MASK, _F16_CARRY = np.uint16(0x7C00), np.uint16(0x0400)
_U32 = np.uint32
# bfloat16 two to a 32-bit word: each half's carry sets that half's top bit and stops there
_BF16X2_MASK, _BF16X2_CARRY, _BF16X2_TOPS = _U32(0x7F807F80), _U32(0x00800080), _U32(0x80008000)
# numba intrinsics the 16-bit kernels call (bit casts, float16 conversions), bound by _jit_kernels
_as_f32 = _as_u32 = _f16_to_f32 = _f32_to_f16 = None


# ----------------------------------------------------------------------------- kernel selection
def set_kernel(name: str | None) -> None:
    """Force a path (``compiled``/``blocked``/``naive``) process-wide, or ``None``: the environment's."""
    global _forced
    if name is not None and name not in KERNELS:
        raise ValueError(f"unknown kernel {name!r}; expected one of {KERNELS}")
    _forced = name


def _requested() -> str:
    """The path asked for, read on every call so a changed environment takes effect."""
    name = _forced or os.environ.get(ENV_VAR, "").strip().lower() or "compiled"
    if name not in KERNELS:
        raise ValueError(f"{ENV_VAR}={name!r}; expected one of {KERNELS}")
    return name


def set_threads(n: int | None) -> None:
    """Threads a large gradient is cut across (``1``: the calling thread only), process-wide, or ``None``
    for the default: ``$POLYAMP_NUMPY_THREADS``, else the usable cpus."""
    global _forced_threads
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        raise ValueError(f"set_threads(n) needs a whole number >= 1 or None, got n={n!r}")
    _forced_threads = n


def threads() -> int:
    """Threads a gradient of at least ``2 * PARALLEL_BYTES`` is cut across now."""
    if _forced_threads is not None:
        return _forced_threads
    text = os.environ.get(THREADS_ENV_VAR, "").strip()
    if not text:
        return _usable_cpus()
    n = int(text) if text.isascii() and text.isdigit() else 0  # isdigit() alone takes '²', int() not
    if n < 1:
        raise ValueError(f"{THREADS_ENV_VAR}={text!r}; expected a whole number >= 1 (1: no extra threads) "
                         f"in ASCII digits. Fix: set {THREADS_ENV_VAR}=4, for one, or unset it")
    return n


@functools.cache
def _usable_cpus() -> int:
    """The cpus this process may run on (its affinity mask where the OS has one), read once."""
    has_mask = hasattr(os, "sched_getaffinity")
    return max(1, len(os.sched_getaffinity(0)) if has_mask else os.cpu_count() or 1)


@functools.cache
def _name(dtype: np.dtype) -> str:
    """``dtype.name``, remembered: NumPy builds that string anew on every access (microseconds)."""
    return dtype.name


def active_kernel() -> str:
    """The path float32 gradients take now (``compiled`` falls back to ``blocked`` without numba); may
    import numba (once) to find out."""
    name = _requested()
    return "blocked" if name == "compiled" and not compiled_available() else name


def compiled_available() -> bool:
    """Whether the numba path imports and compiles here (else the reason is in ``compiled_error``); the
    first call compiles or loads the cached kernels (slow once, then free)."""
    return _load_compiled() is not None


# ----------------------------------------------------------------------------- compiled path
def _scale_check(uint: Any, mask: int, carry: int, top: int) -> Callable[..., bool]:
    """The float32 (or float64) kernel ``(g, inv, scale)``: multiply ``g`` by ``inv`` in place (if
    ``scale``); True if any input was inf/nan. ``uint`` holds ``g``'s bits; (bits & mask) + carry sets
    bit ``top`` exactly for an all-ones exponent, so the OR vectorises."""
    mask, carry, top = uint(mask), uint(carry), uint(top)

    def kernel(g: np.ndarray, inv: Any, scale: bool) -> bool:
        bits = g.view(uint)
        acc = uint(0)
        for i in range(g.size):
            acc = uint(acc | ((bits[i] & mask) + carry))
            if scale:
                g[i] = g[i] * inv
        return (acc >> top) != 0

    return kernel


def _scale_check_f16(g: np.ndarray, inv: np.float32, scale: bool) -> bool:
    """Multiply float16 ``g`` (its uint16 bits) by ``inv`` in float32, round back; True if any was inf/nan.
    As torch: widen (exact), multiply in float32, round to nearest-even once (F16C on x86)."""
    acc = np.uint16(0)
    for i in range(g.size):
        b = g[i]
        acc = np.uint16(acc | ((b & _F16_MASK) + _F16_CARRY))
        if scale:
            g[i] = _f32_to_f16(_f16_to_f32(b) * inv)
    return (acc >> np.uint16(15)) != 0


def _scale_check_bf16(g: np.ndarray, inv: np.float32, scale: bool) -> bool:
    """Multiply bfloat16 ``g`` (its uint16 bits) by ``inv`` in float32, round back; True if any was inf/nan.

    Two values per aligned 32-bit word: widen by a shift or a mask, round as torch does,
    ``(u + 0x7FFF + bit 16 of u) >> 16``. A NaN product has its low 16 bits zero (an input NaN,
    or inf * 0), so it rounds to a NaN; a NaN ``inv`` must not come here.
    """
    head = (g.ctypes.data >> 1) & 1  # a value before the first 4-byte boundary
    pairs = g[head : head + 2 * ((g.size - head) // 2)].view(np.uint32)
    acc = _U32(0)
    for i in range(pairs.size):
        w = pairs[i]
        acc = _U32(acc | _U32(_U32(w & _BF16X2_MASK) + _BF16X2_CARRY))
        if scale:
            lo = _as_u32(_as_f32(_U32(w << _U32(16))) * inv)
            hi = _as_u32(_as_f32(_U32(w & _U32(0xFFFF0000))) * inv)
            lo = _U32(lo + _U32(0x7FFF) + _U32(_U32(lo >> _U32(16)) & _U32(1)))
            hi = _U32(hi + _U32(0x7FFF) + _U32(_U32(hi >> _U32(16)) & _U32(1)))
            pairs[i] = _U32(_U32(hi & _U32(0xFFFF0000)) | _U32(lo >> _U32(16)))
    tail = head + 2 * pairs.size
    for k in range(g.size - 2 * pairs.size):  # the (at most two) values outside the words
        j = k if k < head else tail + k - head
        w = _U32(g[j])
        acc = _U32(acc | _U32(_U32(w & _BF16X2_MASK) + _BF16X2_CARRY))
        if scale:
            u = _as_u32(_as_f32(_U32(w << _U32(16))) * inv)
            g[j] = np.uint16(_U32(u + _U32(0x7FFF) + _U32(_U32(u >> _U32(16)) & _U32(1))) >> _U32(16))
    return _U32(acc & _BF16X2_TOPS) != _U32(0)


def _numba_casts() -> tuple[Any, Any, Any, Any]:
    """numba intrinsics: float32 <-> uint32 bit casts (both ways), float16 bits -> float32 -> float16 bits
    (LLVM's ``half`` conversions: only where ``_native_half()``)."""
    from llvmlite import ir
    from numba import types
    from numba.extending import intrinsic

    def cast(src: Any, dst: Any, emit: Callable[[Any, Any], Any]) -> Any:
        def typer(typingctx: Any, value: Any) -> Any:
            return dst(src), lambda context, builder, sig, args: emit(builder, args[0])

        return intrinsic(typer)

    f32, i32, i16, half = ir.FloatType(), ir.IntType(32), ir.IntType(16), ir.HalfType()
    return (
        cast(types.uint32, types.float32, lambda b, v: b.bitcast(v, f32)),
        cast(types.float32, types.uint32, lambda b, v: b.bitcast(v, i32)),
        cast(types.uint16, types.float32, lambda b, v: b.fpext(b.bitcast(v, half), f32)),
        cast(types.float32, types.uint16, lambda b, v: b.bitcast(b.fptrunc(v, half), i16)),
    )


def _native_half() -> bool:
    """Whether LLVM converts float16 in hardware for numba's target (x86 needs F16C; arm64 always can);
    elsewhere LLVM would call a runtime function numba does not link, which aborts the process."""
    import platform

    from numba.core import codegen, config

    machine = platform.machine().lower()
    if machine in ("aarch64", "arm64"):
        return True
    if machine not in ("x86_64", "amd64"):
        return False
    features = config.CPU_FEATURES if config.CPU_FEATURES is not None else codegen.get_host_cpu_features()
    return "+f16c" in features.split(",")


def _jit_kernels(cache: bool) -> dict[str, Callable[..., bool]]:
    """Compile the kernels for their one signature each (eagerly, so errors show), keyed by dtype name;
    seconds, unless ``cache`` loads them from ``__pycache__``. float16 only where ``_native_half()``."""
    import numba

    global _as_f32, _as_u32, _f16_to_f32, _f32_to_f16
    _as_f32, _as_u32, _f16_to_f32, _f32_to_f16 = _numba_casts()

    def jit(sig: str, fn: Callable[..., bool]) -> Callable[..., bool]:
        return numba.njit(sig, cache=cache, nogil=True)(fn)

    k32 = jit("b1(f4[::1], f4, b1)", _scale_check(np.uint32, 0x7F800000, 0x00800000, 31))
    k64 = jit("b1(f8[::1], f8, b1)", _scale_check(np.uint64, 0x7FF0000000000000, 0x0010000000000000, 63))
    kbf16 = jit("b1(u2[::1], f4, b1)", _scale_check_bf16)
    kernels: dict[str, Callable[..., bool]] = {
        "float32": k32,
        "float64": lambda x, inv, scale: k64(x, np.float64(inv), scale),
        # a NaN inv makes NaN products with any low bits, which the word rounding could carry
        "bfloat16": lambda x, inv, scale: (
            kbf16(x.view(np.uint16), inv, scale) if inv == inv else _blocked(x, inv, scale)
        ),
    }
    dispatchers.update(float32=k32, float64=k64, bfloat16=kbf16)
    if _native_half():
        k16 = jit("b1(u2[::1], f4, b1)", _scale_check_f16)
        kernels["float16"] = lambda x, inv, scale: k16(x.view(np.uint16), inv, scale)
        dispatchers["float16"] = k16
    return kernels


def _load_compiled() -> dict[str, Callable[..., bool]] | None:
    """Import numba and compile (or load from the disk cache) the kernels, once per process; a cache
    that fails to load is bypassed, any other failure kept in ``compiled_error``."""
    global _compiled, _compile_tried, compiled_error
    if _compile_tried:
        return _compiled
    with _lock:
        if not _compile_tried:
            _compile_tried = True
            for cache in (True, False):
                try:
                    _compiled, compiled_error = _jit_kernels(cache), None
                    break
                except Exception as exc:  # noqa: BLE001 - any failure means "use blocked"
                    compiled_error = f"{type(exc).__name__}: {exc}"
    return _compiled


# ----------------------------------------------------------------------------- blocked path
def _limits(dtype: np.dtype) -> tuple[type, type, np.integer, np.integer]:
    """Integer types of ``dtype``'s width and their inf/nan thresholds: +inf/+nan's bits as a signed int
    are >= the exponent mask, -inf/-nan's as an unsigned int >= sign bit | exponent mask."""
    bits = 8 * dtype.itemsize
    signed, unsigned = np.dtype(f"int{bits}").type, np.dtype(f"uint{bits}").type
    mask = _EXP_MASK[_name(dtype)]
    return signed, unsigned, signed(mask), unsigned(mask | 1 << (bits - 1))


def _blocked(x: np.ndarray, inv: np.float32, scale: bool) -> bool:
    """Check then scale a flat gradient block by block; True if any input was inf/nan. Per L2-sized
    block: two integer max-reductions over views, then the in-place multiply while it is in cache."""
    signed, unsigned, pos_lim, neg_lim = _limits(x.dtype)
    as_signed, as_unsigned = x.view(signed), x.view(unsigned)
    step = max(1, BLOCK_BYTES // x.dtype.itemsize)
    bad = False
    for start in range(0, x.size, step):
        stop = start + step
        if not bad:
            bad = bool(np.maximum.reduce(as_signed[start:stop]) >= pos_lim
                       or np.maximum.reduce(as_unsigned[start:stop]) >= neg_lim)
        if scale:
            block = x[start:stop]
            np.multiply(block, inv, out=block)
    return bad


# ----------------------------------------------------------------------------- dispatch
def _naive(g: np.ndarray, inv: np.float32, scale: bool) -> bool:
    """Check then multiply the whole array (any layout): two passes and a boolean temporary."""
    bad = not bool(np.isfinite(g).all())
    if scale:
        np.multiply(g, inv, out=g)
    return bad


def _flat(g: np.ndarray) -> np.ndarray | None:
    """A flat view, in memory order, of contiguous (C or F), aligned, native-order ``g``, else ``None``."""
    if g.flags.aligned and g.dtype.isnative and (g.flags.c_contiguous or g.flags.f_contiguous):
        return g.reshape(-1, order="A")
    return None


def _fast_path(x: np.ndarray, kernel: str) -> Callable[[np.ndarray, np.float32, bool], bool]:
    """The function for flat ``x`` on ``kernel``: the compiled one where it exists and ``x`` is writable."""
    kernels = _load_compiled() if kernel == "compiled" and x.flags.writeable else None
    return kernels.get(_name(x.dtype), _blocked) if kernels else _blocked


def _executor(workers: int) -> ThreadPoolExecutor:
    """The shared pool of ``workers - 1`` threads (the caller runs one part itself); made anew after a
    fork or a change of ``threads()``, the old one left to the garbage collector (a call may use it)."""
    global _pool, _pool_key
    key = (os.getpid(), workers)
    if _pool_key != key or _pool is None:
        from concurrent.futures import ThreadPoolExecutor

        with _lock:
            if _pool_key != key or _pool is None:
                _pool = ThreadPoolExecutor(workers - 1, thread_name_prefix="polyamp-numpy")
                _pool_key = key
    return _pool


def on_threads(run: Callable[[int], Any], parts: int, workers: int) -> list[Any]:
    """``[run(0), ..., run(parts - 1)]``: the first on this thread, the others on the shared pool."""
    if parts < 2:
        return [run(0)]
    from concurrent.futures import wait

    futures = [_executor(workers).submit(run, i) for i in range(1, parts)]
    try:
        first = run(0)
    finally:
        wait(futures)  # never return while a thread still writes the gradient
    return [first] + [f.result() for f in futures]


def _process(g: np.ndarray, inv: np.float32, scale: bool, kernel: str, workers: int) -> bool:
    """Check (and scale, if ``scale``) one gradient on the chosen path; True if it held inf/nan. One of
    at least ``2 * PARALLEL_BYTES`` runs in up to ``workers`` contiguous parts (whole 64-byte lines)."""
    x = _flat(g) if kernel != "naive" else None
    if x is None:
        return _naive(g, inv, scale)
    fn = _fast_path(x, kernel)
    parts = min(workers, x.nbytes // PARALLEL_BYTES)
    if parts < 2:
        return bool(fn(x, inv, scale))
    line = 64 // x.dtype.itemsize
    step = -(-x.size // parts // line) * line

    def part(i: int) -> bool:
        with np.errstate(all="ignore"):  # per thread
            return bool(fn(x[i * step:(i + 1) * step], inv, scale))

    return any(on_threads(part, -(-x.size // step), workers))


def check_writable(grads: Sequence[np.ndarray], scale: bool) -> None:
    """Refuse, before any gradient changes, one of a wrong type or dtype, or a read-only one to scale."""
    for i, g in enumerate(grads):
        if isinstance(g, np.matrix):  # it stays 2-D
            raise TypeError("a gradient is a numpy.matrix; pass np.asarray(m), an ndarray view of its memory")
        if not isinstance(g, np.ndarray) or _name(g.dtype) not in _EXP_MASK:
            raise TypeError("gradients must be float16/bfloat16/float32/float64 ndarrays, "
                            f"got {getattr(g, 'dtype', type(g))}")
        if scale and not g.flags.writeable:
            raise ValueError(
                f"grads[{i}] is a read-only array (numpy.ndarray, shape {g.shape}, dtype {g.dtype}, flags."
                "writeable is False), which cannot be unscaled in place; nothing was changed. Fix: pass "
                "writable gradients (np.array(g) is a writable copy).")


def unscale_and_check_(grads: Sequence[np.ndarray], inv_scale: np.ndarray, found_inf: np.ndarray) -> None:
    """Multiply gradients in place by ``inv_scale``; set ``found_inf`` to 1 (never cleared) if an input
    was inf/nan. One pass per gradient; ``inv_scale == 1`` leaves values as is."""
    if np.size(inv_scale) != 1 or np.size(found_inf) != 1:
        raise ValueError("inv_scale and found_inf must hold exactly one element")
    inv = np.float32(np.asarray(inv_scale).reshape(())[()])
    scale = not inv == 1.0
    kernel, workers = _requested(), threads()
    check_writable(grads, scale)
    bad = False
    with np.errstate(all="ignore"):  # torch is silent about inf/nan/overflow; so are we
        for g in grads:
            bad |= _process(g, inv, scale, kernel, workers)
    if bad:
        found_inf[...] = 1.0


def all_finite(arrays: Sequence[np.ndarray]) -> bool:
    """True if no array holds inf or nan (non-float arrays are always finite): one read pass per float
    array on the same paths as ``unscale_and_check_``, nothing written."""
    kernel, workers = _requested(), threads()
    one = np.float32(1.0)
    with np.errstate(all="ignore"):
        for a in arrays:
            a = np.asarray(a)
            if _name(a.dtype) not in _EXP_MASK:
                if a.dtype.kind in "fc" and not np.isfinite(a).all():
                    return False
            elif _process(a, one, False, kernel, workers):
                return False
    return True
