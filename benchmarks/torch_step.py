"""Cost of one ``unscale_ + step + update`` with polyamp's GradScaler against torch.amp.GradScaler.

Both scalers drive identical parameters with the same optimizer on CPU. Gradients are
refilled (untimed) before every iteration so values stay finite and both sides do the same
work; sides run round-robin within each repetition (order alternating) and the table shows
the median over repetitions of the mean time per iteration. Run:

    python benchmarks/torch_step.py [--reps 30] [--threads 0] [--optimizer sgd-foreach]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from polyamp.compat.torch import GradScaler as PolyampGradScaler

SHAPES = [(10, 1_000), (100, 1_000), (1_000, 100), (10, 1_000_000)]
OPTIMIZERS: dict[str, Callable[[list[Any]], Any]] = {
    "sgd-foreach": lambda ps: torch.optim.SGD(ps, lr=1e-6, foreach=True),
    "sgd-loop": lambda ps: torch.optim.SGD(ps, lr=1e-6, foreach=False),
}


class Side:
    """One scaler with its own parameters and optimizer; ``iteration`` is the timed call."""

    def __init__(self, name: str, scaler: Any, grads: list[Any], make_opt: Callable) -> None:
        self.name, self.scaler = name, scaler
        self.params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
        for param in self.params:
            param.grad = torch.zeros_like(param)
        self.grads = [p.grad for p in self.params]
        self.optimizer = make_opt(self.params)
        scaler.scale(torch.ones(()))  # creates the scale state, as a backward pass would
        self.times: list[float] = []

    def run(self, source: list[Any], iters: int) -> None:
        """``iters`` timed iterations, each after an untimed refill of the gradients."""
        total = 0
        scaler, optimizer = self.scaler, self.optimizer
        for _ in range(iters):
            torch._foreach_copy_(self.grads, source)
            start = time.perf_counter_ns()
            scaler.unscale_(optimizer)
            scaler.step(optimizer)
            scaler.update()
            total += time.perf_counter_ns() - start
        self.times.append(total / iters / 1e3)


def bench_shape(n: int, size: int, reps: int, make_opt: Callable) -> tuple[float, float, bool]:
    """Median microseconds per iteration for torch and polyamp at one shape, and equality."""
    gen = torch.Generator().manual_seed(n * size)
    source = [torch.randn(size, generator=gen) * 2.0**16 for _ in range(n)]
    sides = [
        Side("torch", torch.amp.GradScaler("cpu"), source, make_opt),
        Side("polyamp", PolyampGradScaler("cpu"), source, make_opt),
    ]
    iters = max(1, min(50, 2_000_000 // (n * size)))
    for side in sides:  # warm-up: caches, allocator, first-call costs
        side.run(source, iters)
        side.times.clear()
    for rep in range(reps):
        for side in sides if rep % 2 == 0 else sides[::-1]:
            side.run(source, iters)
    same = all(torch.equal(a, b) for a, b in zip(sides[0].params, sides[1].params, strict=True))
    same = same and sides[0].scaler.get_scale() == sides[1].scaler.get_scale()
    torch_us, polyamp_us = (statistics.median(side.times) for side in sides)
    return torch_us, polyamp_us, same


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=30, help="repetitions per shape")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="sgd-foreach")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"optimizer {args.optimizer}, {args.reps} repetitions, median us per iteration")
    print(f"{'shape':>12} {'torch':>10} {'polyamp':>10} {'ratio':>7}  same result")
    for n, size in SHAPES:
        t_us, p_us, same = bench_shape(n, size, args.reps, OPTIMIZERS[args.optimizer])
        shape = f"{n} x {size // 1000}K" if size >= 1000 else f"{n} x {size}"
        shape = shape.replace("1000K", "1M")
        print(f"{shape:>12} {t_us:>10.1f} {p_us:>10.1f} {p_us / t_us:>6.3f}x  {same}")


if __name__ == "__main__":
    main()
