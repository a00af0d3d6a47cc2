"""Benchmark polyamp's NumPy unscale-and-check against naive NumPy and the bandwidth floor.

Candidates, interleaved round-robin within each repetition (order rotated every repetition):

* ``compiled``: ``unscale_and_check_`` on the numba path;
* ``blocked``:  ``unscale_and_check_`` on the pure-NumPy blocked path;
* ``naive``:    ``g *= inv; np.isfinite(g).all()`` per gradient;
* ``floor``:    an in-place float32 multiply over buffers of the same bytes, split over
  ``--threads`` threads (NumPy releases the GIL): the memory floor any kernel that reads and
  writes the gradients meets. For float32 the buffers are the gradients themselves.

The polyamp paths run with the same number of threads (``set_threads``). All candidates work on
the same arrays. Each repetition uses ``inv = 0.5`` or ``2.0`` alternately, so every value
returns to where it started after two repetitions: the data stays finite and normal (no drift
to zero or inf) and every multiply is exact, in every dtype.

Run: ``python benchmarks/unscale.py [--dtype float32] [--threads N] [--reps 30] [--size 4M] [--count 10]``
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import ModuleType

import numpy as np


def load_kernels() -> ModuleType:
    """Import ``polyamp.backends._numpy_kernels``, or load it from the source tree by path."""
    try:
        from polyamp.backends import _numpy_kernels
    except ImportError:
        path = Path(__file__).resolve().parent.parent / "backends" / "_numpy_kernels.py"
        spec = importlib.util.spec_from_file_location("_polyamp_numpy_kernels", path)
        if spec is None or spec.loader is None:
            raise
        _numpy_kernels = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = _numpy_kernels
        spec.loader.exec_module(_numpy_kernels)
    return _numpy_kernels


def parse_size(text: str) -> int:
    """Parse an element count such as ``4194304``, ``4M`` or ``512K`` (binary multiples)."""
    text = text.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(float(text[:-1] if mult > 1 else text) * mult)


DTYPES = ("float32", "float64", "float16", "bfloat16")


def resolve_dtype(name: str) -> np.dtype:
    """The NumPy dtype called ``name`` (bfloat16 through ml_dtypes)."""
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def make_data(size: int, count: int, dtype: np.dtype) -> list[np.ndarray]:
    """``count`` gradients of normal values in +-[2**-8, 2**8], exact under x0.5 and x2 in ``dtype``."""
    rng = np.random.default_rng(0)
    out = []
    for _ in range(count):
        z = rng.standard_normal(size, dtype=np.float32)
        out.append((np.sign(z) * np.clip(np.abs(z) * 16, 2.0**-8, 2.0**8)).astype(dtype))
    return out


def threaded_floor(pool: ThreadPoolExecutor | None, threads: int) -> Callable:
    """``np.multiply(b, inv, out=b)`` over each buffer, each cut into ``threads`` contiguous parts."""

    def multiply(part: np.ndarray, inv: np.ndarray) -> None:
        np.multiply(part, inv, out=part)

    def floor(buffers: list[np.ndarray], inv: np.ndarray) -> None:
        for b in buffers:
            if pool is None:
                multiply(b, inv)
                continue
            step = -(-b.size // threads)
            parts = [b[i : i + step] for i in range(0, b.size, step)]
            for future in [pool.submit(multiply, p, inv) for p in parts[1:]]:
                future.result()
            multiply(parts[0], inv)

    return floor


def make_candidates(
    kern: ModuleType,
    found: np.ndarray,
    buffers: list[np.ndarray],
    pool: ThreadPoolExecutor | None,
    threads: int,
) -> dict[str, Callable]:
    """The timed functions, each taking ``(grads, inv)`` with ``inv`` a 0-d float32 array."""

    def polyamp_path(name: str) -> Callable:
        def run(grads: list[np.ndarray], inv: np.ndarray) -> None:
            kern.set_kernel(name)
            kern.unscale_and_check_(grads, inv, found)

        return run

    def naive(grads: list[np.ndarray], inv: np.ndarray) -> None:
        ok = True
        for g in grads:
            g *= inv
            ok &= bool(np.isfinite(g).all())
        if not ok:
            found[...] = 1.0

    floor_pass = threaded_floor(pool, threads)

    def floor(grads: list[np.ndarray], inv: np.ndarray) -> None:
        floor_pass(buffers, inv)

    cands = {"compiled": polyamp_path("compiled"), "blocked": polyamp_path("blocked")}
    if not kern.compiled_available():
        del cands["compiled"]
    cands.update(naive=naive, floor=floor)
    return cands


def run(
    reps: int, size: int, count: int, dtype: str = "float32", threads: int = 1, warmup: int = 2
) -> dict[str, list[float]]:
    """Time every candidate ``reps`` times (after ``warmup`` untimed rounds); seconds per call."""
    kern = load_kernels()
    dt = resolve_dtype(dtype)
    grads = make_data(size, count, dt)
    # the floor's buffers: float32 over the same bytes (the gradients themselves for float32)
    buffers = grads if dt == np.float32 else make_data(size * dt.itemsize // 4, count, np.dtype(np.float32))
    found = np.zeros((), np.float32)
    if hasattr(kern, "set_threads"):
        kern.set_threads(threads)
    pool = ThreadPoolExecutor(threads - 1) if threads > 1 else None
    cands = make_candidates(kern, found, buffers, pool, threads)
    names = list(cands)
    times: dict[str, list[float]] = {n: [] for n in names}
    invs = (np.array(0.5, np.float32), np.array(2.0, np.float32))
    for rep in range(warmup + reps):
        inv = invs[rep % 2]
        order = names[rep % len(names) :] + names[: rep % len(names)]
        for name in order:
            t0 = time.perf_counter()
            cands[name](grads, inv)
            elapsed = time.perf_counter() - t0
            if rep >= warmup:
                times[name].append(elapsed)
    kern.set_kernel(None)
    if hasattr(kern, "set_threads"):
        kern.set_threads(None)
    if pool is not None:
        pool.shutdown()
    if found != 0:
        raise AssertionError("finite data flagged as inf/nan")
    return times


RATIOS = [  # (numerator, denominator, target comparison, target)
    ("floor", "compiled", ">=", 0.9),  # the share of the floor's throughput the kernel reaches
    ("compiled", "floor", "<=", 1.3),
    ("naive", "blocked", ">=", 1.3),
    ("naive", "compiled", "", 0.0),
    ("blocked", "floor", "", 0.0),
]


def report(
    times: dict[str, list[float]], size: int, count: int, dtype: str = "float32", threads: int = 1
) -> None:
    """Print median/min ms and effective GB/s per candidate, then the target ratios.

    Ratios are given as the ratio of the medians and as the median of the per-repetition ratios
    (candidates of one repetition ran back to back, so the latter cancels slow drift and load).
    """
    kern = load_kernels()
    nbytes = 2 * resolve_dtype(dtype).itemsize * size * count  # each value read once and written once
    med = {n: statistics.median(t) * 1e3 for n, t in times.items()}
    print(
        f"{count} x {size} {dtype} ({nbytes / 2 / 2**20:.0f} MiB), {len(times['floor'])} reps, "
        f"{threads} threads, {os.cpu_count()} cpus, numpy {np.__version__}, "
        f"block {kern.BLOCK_BYTES // 1024} KiB, "
        f"compiled available: {kern.compiled_available()} {kern.compiled_error or ''}"
    )
    print(f"{'candidate':<10} {'median ms':>10} {'min ms':>8} {'GB/s':>6}")
    for name, t in times.items():
        print(f"{name:<10} {med[name]:>10.2f} {min(t) * 1e3:>8.2f} {nbytes / med[name] / 1e6:>6.1f}")
    print(f"{'ratio':<18} {'of medians':>10} {'paired':>7}  target")
    for a, b, op, limit in RATIOS:
        if a not in med or b not in med:
            continue
        value = med[a] / med[b]
        paired = statistics.median(x / y for x, y in zip(times[a], times[b]))
        verdict = ""
        if op:
            met = value <= limit if op == "<=" else value >= limit
            verdict = f"{op} {limit}: {'met' if met else 'MISSED'}"
        print(f"{a + ' / ' + b:<18} {value:>10.2f} {paired:>7.2f}  {verdict}")


def main(argv: list[str] | None = None) -> None:
    """Parse the options, run the benchmark and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=30, help="timed repetitions (default 30)")
    parser.add_argument("--size", type=parse_size, default=4 << 20, help="elements per gradient")
    parser.add_argument("--count", type=int, default=10, help="number of gradients (default 10)")
    parser.add_argument("--dtype", choices=DTYPES, default="float32", help="gradient dtype (default float32)")
    parser.add_argument(
        "--threads",
        type=int,
        default=len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1,
        help="threads for the floor and for polyamp's kernels (default: the usable cpus)",
    )
    args = parser.parse_args(argv)
    if args.threads < 1:
        parser.error(f"--threads must be at least 1, got {args.threads}")
    times = run(args.reps, args.size, args.count, args.dtype, args.threads)
    report(times, args.size, args.count, args.dtype, args.threads)


if __name__ == "__main__":
    main()
