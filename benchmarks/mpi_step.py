"""polyamp's step agreement over the "mpi" reducer against a bare mpi4py all-reduce of the flag.

Run under ``mpirun --oversubscribe --allow-run-as-root -n 2 $(which python) benchmarks/mpi_step.py``
(``--reps 15``; the full path keeps mpirun on the virtualenv's Python).
Rank 0 prints, per case, the median over repetitions of the mean us per call:

- the bare ``comm.Allreduce`` of 1 float32 (SUM), as torch's ShardedGradScaler would send its flag,
  next to the bare all-reduce of polyamp's message (1 int64, SUM);
- one agreement (``Agreement.flag`` + ``end_iteration``: the digest, the SUM all-reduce of 1 int64
  through the reducer's non-blocking ``Iallreduce`` and its deadline) against that bare flag;
- ``LossScaler.step`` + ``update`` on NumPy gradients (10 x 1K float32) with the reducer, against
  the same scaler without one plus a bare ``Allreduce`` of its flag (the one sync a torch-style
  scaler adds).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
from mpi4py import MPI

import polyamp
import polyamp.distributed
import polyamp.policy
from polyamp._agreement import Agreement


def timed(call: Callable[[], None], iters: int) -> float:
    start = time.perf_counter_ns()
    for _ in range(iters):
        call()
    return (time.perf_counter_ns() - start) / iters / 1e3


def run(reps: int, iters: int = 200) -> None:
    comm = MPI.COMM_WORLD
    red = polyamp.distributed.reducer("mpi")
    flag32, message = np.zeros(1, np.float32), np.zeros(1, np.int64)
    agreement = Agreement(red)
    config = polyamp.LossScaleConfig()
    state = polyamp.policy.HostState(2.0**16)
    found = np.zeros((), np.float32)

    def bare_flag() -> None:
        comm.Allreduce(MPI.IN_PLACE, flag32, op=MPI.SUM)

    def bare_message() -> None:
        comm.Allreduce(MPI.IN_PLACE, message, op=MPI.SUM)

    def agree() -> None:
        agreement.flag(found, config, state)
        agreement.end_iteration()

    grads = [np.random.default_rng(i).standard_normal(1_000).astype(np.float32) for i in range(10)]
    with_reducer = polyamp.LossScaler(reducer=red)
    alone = polyamp.LossScaler()

    def step_polyamp() -> None:
        with_reducer.step(grads, lambda: None)
        with_reducer.update()

    def step_bare() -> None:
        flag32[0] = float(alone.unscale_(grads))  # the local flag, as torch's scaler sends it
        bare_flag()
        alone.step(grads, lambda: None)
        alone.update()

    pairs = {"bare all-reduce: 1 float32 SUM vs 1 int64 SUM": (bare_flag, bare_message),
             "one agreement (mpi reducer) vs bare flag": (bare_flag, agree),
             "LossScaler step, 10 x 1K: bare flag vs reducer": (step_bare, step_polyamp)}
    if comm.rank == 0:
        print(f"{MPI.Get_library_version().splitlines()[0]}, {comm.size} processes, {reps} "
              f"repetitions x {iters} calls; rank 0's median us per call")
        print(f"{'case':>50} {'baseline':>9} {'polyamp':>9} {'ratio':>7}")
    for name, (base, mine) in pairs.items():
        times: tuple[list[float], list[float]] = ([], [])
        for call in (base, mine):  # warm-up
            timed(call, iters)
        for rep in range(reps):
            order = ((0, base), (1, mine)) if rep % 2 == 0 else ((1, mine), (0, base))
            for i, call in order:
                comm.Barrier()
                times[i].append(timed(call, iters))
        b, m = statistics.median(times[0]), statistics.median(times[1])
        if comm.rank == 0:
            print(f"{name:>50} {b:>9.1f} {m:>9.1f} {m / b:>6.3f}x")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=15, help="repetitions per case")
    run(parser.parse_args(argv).reps)


if __name__ == "__main__":
    main()
