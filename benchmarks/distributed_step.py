"""polyamp's ShardedGradScaler against torch's on gloo: time per step and collectives per step.

Two processes on this machine join a gloo group; in each, both scalers drive identical
parameters with the same gradients (refilled, untimed, before every iteration) and the same
optimizer. The timed part is ``scaler.step(optimizer)`` for every optimizer plus
``scaler.update()``. Sides run round-robin within each repetition (order alternating); the
table shows rank 0's median over repetitions of the mean time per iteration, the ratio
polyamp / torch, the all-reduces each side issued per step (``dist.all_reduce`` plus the
functional all-reduce DTensor uses) and whether both ended bitwise equal. Last, the bare latency
of one all-reduce of torch's flag (1 float32, SUM) against polyamp's agreement message (1 int64,
SUM: the flags' count and the digest check that finds misaligned ranks) and its message with extra
values (2 float64, MAX, before the slots). Run:

    python benchmarks/distributed_step.py [--reps 15] [--case "2 optimizers"] [--ranks 2]

The same under MPI: ``benchmarks/mpi_step.py``.
"""

from __future__ import annotations

import argparse
import math
import os
import socket
import statistics
import time
import warnings
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.multiprocessing as mp
from polyamp.compat.torch import ShardedGradScaler
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler as TorchSharded

#: name -> (optimizers, tensors per optimizer, elements per tensor); "fsdp2": a fully_shard MLP
CASES: dict[str, tuple[int, int, int]] = {
    "1 optimizer, 10 x 1K": (1, 10, 1_000),
    "1 optimizer, 100 x 10K": (1, 100, 10_000),
    "2 optimizers, 10 x 1K each": (2, 10, 1_000),
    "fsdp2 fully_shard MLP": (1, 0, 0),
}


class Count:
    """Counts all-reduces: ``dist.all_reduce`` (torch's scaler, polyamp's reducer) and DTensor's."""

    def __init__(self) -> None:
        self.count = 0
        dist.all_reduce = self.wrap(dist.all_reduce)
        funcol.all_reduce = self.wrap(funcol.all_reduce)

    def wrap(self, call: Any) -> Any:
        def counted(*args: Any, **kwargs: Any) -> Any:
            self.count += 1
            return call(*args, **kwargs)

        return counted


def fsdp_model(rank: int) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    gen = torch.Generator().manual_seed(rank)
    model(torch.randn(8, 256, generator=gen)).square().mean().mul(2.0**16).backward()  # creates .grad
    return model


class Side:
    """One scaler with its own parameters, optimizers and gradient source."""

    def __init__(self, name: str, scaler: Any, case: tuple[int, int, int], rank: int) -> None:
        self.name, self.scaler, self.times = name, scaler, []
        n_opt, n, size = case
        if n_opt and n:
            gen = torch.Generator().manual_seed(rank)
            source = [torch.randn(size, generator=gen) * 2.0**16 for _ in range(n_opt * n)]
            self.params = [torch.nn.Parameter(torch.zeros(size)) for _ in source]
            for param in self.params:
                param.grad = torch.zeros_like(param)
            groups = [self.params[i * n:(i + 1) * n] for i in range(n_opt)]
            self.grads = [p.grad for p in self.params]
        else:
            model = fsdp_model(rank)
            self.params = list(model.parameters())
            groups = [self.params]
            self.grads = [p.grad.to_local() for p in self.params]
            source = [g.clone() for g in self.grads]
        self.source = source
        self.optimizers = [torch.optim.SGD(g, lr=1e-9) for g in groups]
        scaler.scale(torch.ones(()))  # creates the scale, as a backward pass would
        self.calls = 0

    def run(self, iters: int, counter: Count) -> None:
        total = 0
        scaler = self.scaler
        for _ in range(iters):
            torch._foreach_copy_(self.grads, self.source)
            before = counter.count
            start = time.perf_counter_ns()
            for optimizer in self.optimizers:
                scaler.step(optimizer)
            scaler.update()
            total += time.perf_counter_ns() - start
            self.calls += counter.count - before
        self.times.append(total / iters / 1e3)


def local(param: Any) -> Any:
    return param.to_local() if hasattr(param, "to_local") else param


def bench(rank: int, case: tuple[int, int, int], reps: int, counter: Count) -> tuple[Any, ...]:
    """torch's and polyamp's median us per step, their all-reduces per step, and equality."""
    sides = [Side("torch", TorchSharded("cpu"), case, rank),
             Side("polyamp", ShardedGradScaler("cpu"), case, rank)]
    iters = max(2, min(40, 2_000_000 // max(1, case[0] * case[1] * case[2])))
    for side in sides:  # warm-up
        side.run(iters, counter)
        side.times.clear()
        side.calls = 0
    for rep in range(reps):
        for side in sides if rep % 2 == 0 else sides[::-1]:
            side.run(iters, counter)
    same = all(torch.equal(local(a), local(b)) for a, b in zip(sides[0].params, sides[1].params, strict=True))
    same = same and sides[0].scaler.get_scale() == sides[1].scaler.get_scale()
    steps = reps * iters
    t_us, p_us = (statistics.median(side.times) for side in sides)
    return t_us, p_us, sides[0].calls // steps, sides[1].calls // steps, same


def allreduce_latency(reps: int) -> tuple[float, float, float]:
    """The best us of one bare ``dist.all_reduce`` of torch's flag (1 float32, SUM), of polyamp's
    agreement message (1 int64, SUM) and of its message with extra values or in groups above 1023
    ranks (2 float64, MAX, before its slots), taken in turn in the same run."""
    buffers = [(torch.zeros(1), dist.ReduceOp.SUM), (torch.zeros(1, dtype=torch.int64), dist.ReduceOp.SUM),
               (torch.zeros(2, dtype=torch.float64), dist.ReduceOp.MAX)]
    best = [math.inf] * len(buffers)
    for _ in range(reps):
        for i, (buffer, op) in enumerate(buffers):
            start = time.perf_counter_ns()
            for _ in range(100):
                dist.all_reduce(buffer, op=op)
            best[i] = min(best[i], (time.perf_counter_ns() - start) / 100 / 1e3)
    return best[0], best[1], best[2]


def worker(rank: int, size: int, port: int, reps: int, only: str = "") -> None:
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message="Found a non-scalar tensor")  # torch's (1,)-shaped flag
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size,
                            timeout=timedelta(seconds=60))
    counter = Count()
    if rank == 0:
        print(f"torch {torch.__version__}, gloo, {size} processes, 1 thread each, {reps} repetitions; "
              "rank 0's median us per step (step(optimizer) for each optimizer + update())")
        print(f"{'case':>28} {'torch':>9} {'polyamp':>9} {'ratio':>7} {'all-reduces/step':>17}  same")
    for name, case in CASES.items():
        if only not in name:
            continue
        t_us, p_us, t_calls, p_calls, same = bench(rank, case, reps, counter)
        if rank == 0:
            calls = f"{t_calls:>8} vs {p_calls:<6}"
            print(f"{name:>28} {t_us:>9.1f} {p_us:>9.1f} {p_us / t_us:>6.3f}x {calls}  {same}")
    flag_us, message_us, head_us = allreduce_latency(reps)
    if rank == 0:
        print(f"one bare all-reduce, best of {reps} x 100: torch's flag (1 float32, SUM) {flag_us:.1f} us, "
              f"polyamp's message (1 int64, SUM) {message_us:.1f} us, with extra values (2 float64, "
              f"MAX) {head_us:.1f} us")
    dist.barrier()
    os._exit(0)  # skip the process group's teardown


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=15, help="repetitions per case")
    parser.add_argument("--case", default="", help="only the cases whose name contains this text")
    parser.add_argument("--ranks", type=int, default=2,
                        help="processes (1: a group of one: the scalers' own time, no peer to wait for)")
    args = parser.parse_args(argv)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.spawn(worker, args=(args.ranks, port, args.reps, args.case), nprocs=args.ranks)


if __name__ == "__main__":
    main()
