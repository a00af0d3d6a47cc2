"""A torch training step built from polyamp.functional under ``torch.compile(fullgraph=True)``
against the eager ``polyamp.GradScaler`` loop (and the same functional step uncompiled).

Each side trains its own copy of one MLP (two linear layers, tanh) with SGD and momentum on the
same batches, an overflow injected every 50th step (the loss times inf). The eager facade runs
``scale(loss).backward(); step(optimizer); update()`` (one host read per step: the skip); the
functional step computes ``torch.func.grad`` of the scaled loss, ``unscale``, the momentum update,
``where_finite`` and ``update`` with no host read. Sides run round-robin within each repetition;
the table shows the median over repetitions of the mean time per step, and whether the sides'
scales agree at the end. A report, not a target. Run:

    python benchmarks/functional_step.py [--reps 10] [--steps 100] [--threads 0]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

import polyamp
from polyamp import functional as F

LR, MOMENTUM, BATCH = 0.01, 0.9, 64
WIDTHS = [64, 512]
CONFIG = polyamp.LossScaleConfig(init_scale=2.0**10, growth_interval=20)


def _loss(params: dict[str, Any], x: Any, y: Any, poison: Any) -> Any:
    hidden = torch.tanh(x @ params["w1"] + params["b1"])
    return ((hidden @ params["w2"] + params["b2"] - y) ** 2).mean() * poison


def functional_step(params, bufs, ls, x, y, poison):
    """One step, no host read: the skip is where_finite over parameters and momentum."""
    scaled = torch.func.grad(lambda p: F.scale(ls, _loss(p, x, y, poison)))(params)
    grads, found_inf = F.unscale(ls, scaled)
    new_bufs = {k: bufs[k] * MOMENTUM + grads[k] for k in params}
    new_params = {k: params[k] - LR * new_bufs[k] for k in params}
    return (F.where_finite(found_inf, new_params, params), F.where_finite(found_inf, new_bufs, bufs),
            F.update(ls, found_inf, CONFIG))


class Functional:
    def __init__(self, start: dict[str, Any], step: Any) -> None:
        self.params = {k: v.clone() for k, v in start.items()}
        self.bufs = {k: torch.zeros_like(v) for k, v in start.items()}
        self.ls = F.init(CONFIG, like=start["w1"])
        self.step = step

    def run(self, batches: list[tuple[Any, Any, Any]]) -> None:
        params, bufs, ls, step = self.params, self.bufs, self.ls, self.step
        for x, y, poison in batches:
            params, bufs, ls = step(params, bufs, ls, x, y, poison)
        self.params, self.bufs, self.ls = params, bufs, ls

    def scale(self) -> float:
        return float(self.ls.scale)


class Facade:
    def __init__(self, start: dict[str, Any]) -> None:
        self.params = {k: torch.nn.Parameter(v.clone()) for k, v in start.items()}
        self.optimizer = torch.optim.SGD(self.params.values(), lr=LR, momentum=MOMENTUM)
        self.scaler = polyamp.GradScaler("cpu", init_scale=CONFIG.init_scale,
                                         growth_interval=CONFIG.growth_interval)

    def run(self, batches: list[tuple[Any, Any, Any]]) -> None:
        for x, y, poison in batches:
            self.optimizer.zero_grad()
            self.scaler.scale(_loss(self.params, x, y, poison)).backward()
            self.scaler.step(self.optimizer)
            self.scaler.update()

    def scale(self) -> float:
        return self.scaler.get_scale()


def bench_width(width: int, reps: int, steps: int) -> tuple[dict[str, float], bool]:
    gen = torch.Generator().manual_seed(width)
    start = {"w1": torch.randn(32, width, generator=gen) * 0.1, "b1": torch.zeros(width),
             "w2": torch.randn(width, 1, generator=gen) * 0.1, "b2": torch.zeros(1)}
    batches = [(torch.randn(BATCH, 32, generator=gen), torch.randn(BATCH, 1, generator=gen),
                torch.tensor(float("inf") if i % 50 == 49 else 1.0)) for i in range(steps)]
    torch._dynamo.reset()
    sides = {"eager facade": Facade(start), "functional eager": Functional(start, functional_step),
             "functional compiled": Functional(start, torch.compile(functional_step, fullgraph=True))}
    for side in sides.values():  # warm-up: compiles, allocates the optimizer state
        side.run(batches[:2])
    times: dict[str, list[float]] = {name: [] for name in sides}
    for rep in range(reps):
        order = list(sides) if rep % 2 == 0 else list(reversed(sides))
        for name in order:
            begin = time.perf_counter_ns()
            sides[name].run(batches)
            times[name].append((time.perf_counter_ns() - begin) / steps / 1e3)
    scales = {side.scale() for side in sides.values()}
    return {name: statistics.median(t) for name, t in times.items()}, len(scales) == 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.reps} repetitions of "
          f"{args.steps} steps, median us per step; ratio = side / eager facade (below 1 is faster)")
    print(f"{'width':>6} {'eager facade':>13} {'functional eager':>17} {'ratio':>7} "
          f"{'compiled':>10} {'ratio':>7}  same scale")
    for width in WIDTHS:
        t, same = bench_width(width, args.reps, args.steps)
        base, eager, compiled = t["eager facade"], t["functional eager"], t["functional compiled"]
        print(f"{width:>6} {base:>13.1f} {eager:>17.1f} {eager / base:>6.3f}x "
              f"{compiled:>10.1f} {compiled / base:>6.3f}x  {same}")


if __name__ == "__main__":
    main()
