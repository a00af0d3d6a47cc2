"""Cost of a step with a gradient-norm StepGuard against one without: ``step + update`` of a LossScaler.

Both sides unscale the same gradients (refilled, untimed, before every iteration) with the same
config; the guarded side also computes the global norm (``sum_of_squares``, float64) and judges
it, reading it in the step's one host read. Sides run round-robin within each repetition (order
alternating); the table shows the median over repetitions of the time per iteration, and the
ratio guarded / unguarded (target: <= 1.1). Run:

    python benchmarks/guard_step.py [--tensors 100] [--size 1000000] [--reps 7] [--backends numpy,torch]
                                    [--threads N]  (torch's intra-op threads; default: torch's own)
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import numpy as np

from polyamp import LossScaleConfig, LossScaler, StepGuard

CONFIG = LossScaleConfig(init_scale=2.0**10, growth_interval=10**9)  # the scale stays: equal work
GUARD = StepGuard(grad_norm_zscore=6.0, window=128)


def _arrays(backend: str, n: int, size: int) -> tuple[list[Any], list[Any], Any]:
    """Source values, the gradients the steps unscale, and a copy function (source -> gradients)."""
    rng = np.random.default_rng(0)
    source = [(rng.standard_normal(size, dtype=np.float32) * 2.0**10) for _ in range(n)]
    if backend == "torch":
        import torch

        src = [torch.from_numpy(s) for s in source]
        grads = [torch.empty_like(s) for s in src]
        return src, grads, lambda: torch._foreach_copy_(grads, src)
    grads = [np.empty_like(s) for s in source]

    def refill() -> None:
        for g, s in zip(grads, source):
            np.copyto(g, s)

    return source, grads, refill


def bench(backend: str, n: int, size: int, reps: int) -> tuple[float, float]:
    """Median milliseconds per step for the unguarded and the guarded scaler."""
    _, grads, refill = _arrays(backend, n, size)
    sides = {"none": LossScaler(CONFIG, backend), "grad-norm guard": LossScaler(CONFIG, backend, guard=GUARD)}
    times: dict[str, list[float]] = {name: [] for name in sides}
    for rep in range(reps + 1):  # the first repetition warms up and is dropped
        order = list(sides) if rep % 2 else list(reversed(sides))
        for name in order:
            refill()
            start = time.perf_counter()
            result = sides[name].step(grads, lambda: None)
            sides[name].update()
            elapsed = time.perf_counter() - start
            assert result.applied
            if rep:
                times[name].append(elapsed * 1e3)
    return statistics.median(times["none"]), statistics.median(times["grad-norm guard"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensors", type=int, default=100)
    parser.add_argument("--size", type=int, default=1_000_000)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--backends", default="numpy,torch")
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads and "torch" in args.backends:
        import torch

        torch.set_num_threads(args.threads)
    print(f"{args.tensors} x {args.size} float32 gradients, median of {args.reps} steps")
    print(f"{'backend':8} {'none (ms)':>10} {'guarded (ms)':>13} {'ratio':>6}")
    for backend in args.backends.split(","):
        plain, guarded = bench(backend, args.tensors, args.size, args.reps)
        print(f"{backend:8} {plain:10.1f} {guarded:13.1f} {guarded / plain:6.2f}")


if __name__ == "__main__":
    main()
