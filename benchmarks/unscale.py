"""Benchmark polyamp's NumPy unscale-and-check against naive NumPy and the bandwidth floor.

Candidates, interleaved round-robin within each repetition (order rotated every repetition):

* ``compiled``: ``unscale_and_check_`` on the numba path;
* ``blocked``:  ``unscale_and_check_`` on the pure-NumPy blocked path;
* ``naive``:    ``g *= inv; np.isfinite(g).all()`` per gradient;
* ``floor``:    ``np.multiply(g, inv, out=g)`` per gradient (one in-place pass: the memory floor).

All candidates work on the same arrays. Each repetition uses ``inv = 0.5`` or ``2.0``
alternately, so every value returns to where it started after two repetitions: the data stays
finite and normal (no drift to zero or inf) and every multiply is exact.

Run: ``python benchmarks/unscale.py [--reps 30] [--size 4M] [--count 10]``
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time
from collections.abc import Callable
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


def make_candidates(kern: ModuleType, found: np.ndarray) -> dict[str, Callable]:
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

    def floor(grads: list[np.ndarray], inv: np.ndarray) -> None:
        for g in grads:
            np.multiply(g, inv, out=g)

    cands = {"compiled": polyamp_path("compiled"), "blocked": polyamp_path("blocked")}
    if not kern.compiled_available():
        del cands["compiled"]
    cands.update(naive=naive, floor=floor)
    return cands


def run(reps: int, size: int, count: int, warmup: int = 2) -> dict[str, list[float]]:
    """Time every candidate ``reps`` times (after ``warmup`` untimed rounds); seconds per call."""
    kern = load_kernels()
    rng = np.random.default_rng(0)
    grads = [rng.standard_normal(size, dtype=np.float32) * np.float32(2**16) for _ in range(count)]
    found = np.zeros((), np.float32)
    cands = make_candidates(kern, found)
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
    if found != 0:
        raise AssertionError("finite data flagged as inf/nan")
    return times


RATIOS = [  # (numerator, denominator, target comparison, target)
    ("compiled", "floor", "<=", 1.3),
    ("naive", "blocked", ">=", 1.3),
    ("naive", "compiled", "", 0.0),
    ("blocked", "floor", "", 0.0),
]


def report(times: dict[str, list[float]], size: int, count: int) -> None:
    """Print median/min ms and effective GB/s per candidate, then the target ratios.

    Ratios are given as the ratio of the medians and as the median of the per-repetition ratios
    (candidates of one repetition ran back to back, so the latter cancels slow drift and load).
    """
    kern = load_kernels()
    nbytes = 2 * 4 * size * count  # each value read once and written once
    med = {n: statistics.median(t) * 1e3 for n, t in times.items()}
    print(
        f"{count} x {size} float32 ({nbytes / 2 / 2**20:.0f} MiB), {len(times['floor'])} reps, "
        f"{os.cpu_count()} cpus, numpy {np.__version__}, block {kern.BLOCK_BYTES // 1024} KiB, "
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
    args = parser.parse_args(argv)
    report(run(args.reps, args.size, args.count), args.size, args.count)


if __name__ == "__main__":
    main()
