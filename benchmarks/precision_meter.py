"""Cost of a PrecisionMeter: ``step + update`` of a LossScaler on a sample step and on a non-sample step,
each as a ratio against the same step without a meter, side by side in one run.

Three scalers per backend and case, same config and gradients (refilled, untimed, before every step):
no meter; ``PrecisionMeter(every=10**9)`` (every timed step is a non-sample step: its one sample is
the untimed warm-up); ``PrecisionMeter(every=1)`` (every step a sample step: the counts fused into
the unscale, plus the report's host read). Default targets (float16 at the loss scale, bfloat16 at 1).
Sides run round-robin (order alternating); each repetition times ``--steps`` steps per side, the table
shows the median over ``--reps`` repetitions of the mean time per step. Goal (issue 33): non-sample
1.00x, sample <= 1.5x on 100 x 1M float32. Run:

    python benchmarks/precision_meter.py [--cases 100x1000000,100x10000] [--reps 3] [--steps 5]
                                         [--backends numpy,torch] [--threads N]  (torch's intra-op threads)
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import numpy as np

from polyamp import LossScaleConfig, LossScaler, PrecisionMeter

CONFIG = LossScaleConfig(init_scale=2.0**10, growth_interval=10**9)  # the scale stays: equal work
SIDES = {"none": None, "non-sample": PrecisionMeter(every=10**9), "sample": PrecisionMeter(every=1)}


def _arrays(backend: str, n: int, size: int) -> tuple[list[Any], Any]:
    """The gradients the steps unscale, and a function refilling them with the same scaled values
    (standard normal * 1e-4, scaled by 2**10: some fall under float16's normal range unscaled)."""
    rng = np.random.default_rng(0)
    source = [(rng.standard_normal(size, dtype=np.float32) * np.float32(1e-4 * 2.0**10)) for _ in range(n)]
    if backend == "torch":
        import torch

        src = [torch.from_numpy(s) for s in source]
        grads = [torch.empty_like(s) for s in src]
        return grads, lambda: torch._foreach_copy_(grads, src)
    grads = [np.empty_like(s) for s in source]

    def refill() -> None:
        for g, s in zip(grads, source):
            np.copyto(g, s)

    return grads, refill


def bench(backend: str, n: int, size: int, reps: int, steps: int) -> dict[str, float]:
    """Median over ``reps`` of the mean milliseconds per step, per side."""
    grads, refill = _arrays(backend, n, size)
    scalers = {name: LossScaler(CONFIG, backend, meter=meter) for name, meter in SIDES.items()}
    times: dict[str, list[float]] = {name: [] for name in scalers}
    for rep in range(reps + 1):  # the first repetition warms up (and compiles) and is dropped
        order = list(scalers) if rep % 2 else list(reversed(scalers))
        for name in order:
            total = 0.0
            for _ in range(steps):
                refill()
                start = time.perf_counter()
                result = scalers[name].step(grads, lambda: None)
                scalers[name].update()
                total += time.perf_counter() - start
                assert result.applied
            if rep:
                times[name].append(total / steps * 1e3)
    assert scalers["sample"].last_precision.step == (reps + 1) * steps - 1  # the last step sampled
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="100x1000000,100x10000", help="TENSORSxSIZE, comma-separated")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--backends", default="numpy,torch")
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads and "torch" in args.backends:
        import torch

        torch.set_num_threads(args.threads)
    print(f"float32 gradients, median of {args.reps} repetitions of {args.steps} steps")
    print(f"{'case':>14} {'backend':8} {'no meter (ms)':>14} {'non-sample':>11} {'sample':>7}")
    for case in args.cases.split(","):
        n, size = (int(v) for v in case.lower().split("x"))
        for backend in args.backends.split(","):
            t = bench(backend, n, size, args.reps, args.steps)
            print(f"{case:>14} {backend:8} {t['none']:14.2f} {t['non-sample'] / t['none']:10.2f}x "
                  f"{t['sample'] / t['none']:6.2f}x")


if __name__ == "__main__":
    main()
