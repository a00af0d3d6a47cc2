"""NumPy fused unscale-and-check, as torch's ``_amp_foreach_non_finite_check_and_unscale_``.

Three interchangeable paths give bit-identical gradients and the same flag:

* ``compiled``: one numba loop per float32/float64 gradient that reads each value once, ORs the
  exponent bits into an integer flag and writes ``v * inv`` (compiled lazily, cached on disk);
* ``blocked``: pure NumPy over cache-sized blocks, so the check and the multiply share one trip
  through memory;
* ``naive``: ``isfinite(g).all()`` then ``g *= inv`` (two passes and a gradient-sized temporary).

The path is ``set_kernel(name)`` if set, else ``$POLYAMP_NUMPY_KERNEL``, else ``compiled`` when
numba imports (``blocked`` otherwise). Importing this module imports only NumPy.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

__all__ = [
    "ENV_VAR",
    "KERNELS",
    "active_kernel",
    "all_finite",
    "compiled_available",
    "set_kernel",
    "unscale_and_check_",
]

ENV_VAR = "POLYAMP_NUMPY_KERNEL"
KERNELS = ("compiled", "blocked", "naive")
#: Bytes per block of the blocked path: the check and the multiply of a block hit L2, not DRAM.
BLOCK_BYTES = 512 * 1024

#: Why the compiled path is unavailable (``None`` while it works or has not been tried yet).
compiled_error: str | None = None

_forced: str | None = None
_compiled: dict[np.dtype, Callable[..., bool]] | None = None
_compile_tried = False
_lock = threading.Lock()

# Exponent mask per dtype name: a value is inf/nan exactly when all its exponent bits are set.
_EXP_MASK = {
    "float16": 0x7C00,
    "bfloat16": 0x7F80,
    "float32": 0x7F800000,
    "float64": 0x7FF0000000000000,
}
_F32_MASK, _F32_CARRY = np.uint32(0x7F800000), np.uint32(0x00800000)
_F64_MASK, _F64_CARRY = np.uint64(0x7FF0000000000000), np.uint64(0x0010000000000000)


# ----------------------------------------------------------------------------- kernel selection
def set_kernel(name: str | None) -> None:
    """Force a path (``compiled``/``blocked``/``naive``), or ``None`` to defer to the environment.

    Process-wide; meant for tests and benchmarks that compare the paths.
    """
    global _forced
    if name is not None and name not in KERNELS:
        raise ValueError(f"unknown kernel {name!r}; expected one of {KERNELS}")
    _forced = name


def _requested() -> str:
    """The path asked for: ``set_kernel``, then ``$POLYAMP_NUMPY_KERNEL``, then ``compiled``.

    Read on every call so a changed environment takes effect without a re-import.
    """
    name = _forced or os.environ.get(ENV_VAR, "").strip().lower() or "compiled"
    if name not in KERNELS:
        raise ValueError(f"{ENV_VAR}={name!r}; expected one of {KERNELS}")
    return name


def active_kernel() -> str:
    """The path float32 gradients take now (``compiled`` falls back to ``blocked`` without numba).

    May import numba (once) to find out.
    """
    name = _requested()
    return "blocked" if name == "compiled" and not compiled_available() else name


def compiled_available() -> bool:
    """Whether the numba path imports and compiles here (the reason is kept in ``compiled_error``).

    The first call imports numba and compiles or loads the cached kernels (slow once, then free).
    """
    return _load_compiled() is not None


def __getattr__(name: str) -> Any:
    """Compute ``COMPILED_AVAILABLE`` on first access so importing the module stays cheap."""
    if name == "COMPILED_AVAILABLE":
        return compiled_available()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ----------------------------------------------------------------------------- compiled path
def _scale_check_f32(g: np.ndarray, inv: np.float32, scale: bool) -> bool:
    """Multiply float32 ``g`` by ``inv`` in place (if ``scale``); True if any input was inf/nan.

    (bits & mask) + carry sets bit 31 exactly for an all-ones exponent, so the OR vectorises.
    """
    bits = g.view(np.uint32)
    acc = np.uint32(0)
    for i in range(g.size):
        acc = np.uint32(acc | ((bits[i] & _F32_MASK) + _F32_CARRY))
        if scale:
            g[i] = g[i] * inv
    return (acc >> np.uint32(31)) != 0


def _scale_check_f64(g: np.ndarray, inv: np.float64, scale: bool) -> bool:
    """Multiply float64 ``g`` by ``inv`` in place (if ``scale``); True if any input was inf/nan.

    Same exponent-carry trick as the float32 kernel, on 64-bit words.
    """
    bits = g.view(np.uint64)
    acc = np.uint64(0)
    for i in range(g.size):
        acc = np.uint64(acc | ((bits[i] & _F64_MASK) + _F64_CARRY))
        if scale:
            g[i] = g[i] * inv
    return (acc >> np.uint64(63)) != 0


def _jit_kernels(cache: bool) -> dict[np.dtype, Callable[..., bool]]:
    """Compile the float32/float64 kernels for their one signature each (eagerly, so errors show).

    Seconds when compiling; with ``cache`` a later process loads them from ``__pycache__`` instead.
    """
    import numba

    def jit(sig: str, fn: Callable[..., bool]) -> Callable[..., bool]:
        return numba.njit(sig, cache=cache, nogil=True)(fn)

    return {
        np.dtype(np.float32): jit("b1(f4[::1], f4, b1)", _scale_check_f32),
        np.dtype(np.float64): jit("b1(f8[::1], f8, b1)", _scale_check_f64),
    }


def _load_compiled() -> dict[np.dtype, Callable[..., bool]] | None:
    """Import numba and compile (or load from the disk cache) the kernels, once per process.

    A cache that fails to load is bypassed; any other failure is kept in ``compiled_error``.
    """
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
    """Signed and unsigned integer types of ``dtype``'s width, and their inf/nan thresholds.

    A value is +inf/+nan iff its bits as a signed int are >= the exponent mask, and -inf/-nan
    iff its bits as an unsigned int are >= sign bit | exponent mask.
    """
    bits = 8 * dtype.itemsize
    signed, unsigned = np.dtype(f"int{bits}").type, np.dtype(f"uint{bits}").type
    mask = _EXP_MASK[dtype.name]
    return signed, unsigned, signed(mask), unsigned(mask | 1 << (bits - 1))


def _blocked(x: np.ndarray, inv: np.float32, scale: bool) -> bool:
    """Check then scale a flat gradient block by block; True if any input was inf/nan.

    Per L2-sized block: two integer max-reductions over views (no scratch, no BLAS), then the
    in-place multiply while the block is still in cache: DRAM sees one read and one write.
    """
    signed, unsigned, pos_lim, neg_lim = _limits(x.dtype)
    as_signed, as_unsigned = x.view(signed), x.view(unsigned)
    step = max(1, BLOCK_BYTES // x.dtype.itemsize)
    bad = False
    for start in range(0, x.size, step):
        stop = start + step
        if not bad:
            bad = bool(
                np.maximum.reduce(as_signed[start:stop]) >= pos_lim
                or np.maximum.reduce(as_unsigned[start:stop]) >= neg_lim
            )
        if scale:
            block = x[start:stop]
            np.multiply(block, inv, out=block)
    return bad


# ----------------------------------------------------------------------------- dispatch
def _naive(g: np.ndarray, inv: np.float32, scale: bool) -> bool:
    """Check then multiply the whole array (any layout); True if any input was inf/nan.

    Two passes over memory plus a gradient-sized boolean temporary: the reference and fallback.
    """
    bad = not bool(np.isfinite(g).all())
    if scale:
        np.multiply(g, inv, out=g)
    return bad


def _flat(g: np.ndarray) -> np.ndarray | None:
    """A flat 1-D view of ``g`` if the fast paths can take it, else ``None``.

    Needs contiguous (C or F), aligned, native-order memory; anything else goes to ``_naive``.
    """
    if not (g.flags.aligned and g.dtype.isnative):
        return None
    if g.flags.c_contiguous:
        return g.reshape(-1)
    if g.flags.f_contiguous:
        return g.T.reshape(-1)
    return None


def _check_dtype(g: np.ndarray) -> None:
    """Raise TypeError unless ``g`` holds float16, bfloat16, float32 or float64 (as torch does).

    Cheap: a dtype-name lookup. np.matrix is refused: it stays 2-D under reshape(-1).
    """
    if isinstance(g, np.matrix):
        raise TypeError("a gradient is a numpy.matrix; pass np.asarray(m), an ndarray view of its memory")
    if not isinstance(g, np.ndarray) or g.dtype.name not in _EXP_MASK:
        raise TypeError(
            f"gradients must be float16/bfloat16/float32/float64 ndarrays, got {getattr(g, 'dtype', type(g))}"
        )


def _process(g: np.ndarray, inv: np.float32, scale: bool, kernel: str) -> bool:
    """Check (and scale, if ``scale``) one gradient on the chosen path; True if it held inf/nan.

    Compiled kernels exist for float32/float64 only; float16/bfloat16 take the blocked path.
    """
    x = _flat(g) if kernel != "naive" else None
    if x is None:
        return _naive(g, inv, scale)
    if kernel == "compiled" and x.flags.writeable:
        kernels = _load_compiled()
        fn = kernels.get(x.dtype) if kernels else None
        if fn is not None:
            return bool(fn(x, x.dtype.type(inv), scale))
    return _blocked(x, inv, scale)


def unscale_and_check_(grads: Sequence[np.ndarray], inv_scale: np.ndarray, found_inf: np.ndarray) -> None:
    """Multiply gradients in place by ``inv_scale``; set ``found_inf`` to 1 if an input was inf/nan.

    One pass per gradient; ``found_inf`` is never cleared; ``inv_scale == 1`` leaves values as is.
    """
    if np.size(inv_scale) != 1 or np.size(found_inf) != 1:
        raise ValueError("inv_scale and found_inf must hold exactly one element")
    inv = np.float32(np.asarray(inv_scale).reshape(())[()])
    scale = not inv == 1.0
    kernel = _requested()
    for g in grads:
        _check_dtype(g)
        if scale and not g.flags.writeable:
            raise ValueError("gradient is read-only")
    bad = False
    with np.errstate(all="ignore"):  # torch is silent about inf/nan/overflow; so are we
        for g in grads:
            bad |= _process(g, inv, scale, kernel)
    if bad:
        found_inf[...] = 1.0


def all_finite(arrays: Sequence[np.ndarray]) -> bool:
    """True if no array holds inf or nan (non-float arrays are always finite).

    One read pass per float array on the same paths as ``unscale_and_check_``, nothing written.
    """
    kernel = _requested()
    one = np.float32(1.0)
    with np.errstate(all="ignore"):
        for a in arrays:
            a = np.asarray(a)
            if a.dtype.name not in _EXP_MASK:
                if a.dtype.kind in "fc" and not np.isfinite(a).all():
                    return False
            elif _process(a, one, False, kernel):
                return False
    return True
