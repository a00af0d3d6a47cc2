"""A real two-rank run of the data-parallel trainer with a StepGuard: rank 1 alone sees a corrupted
batch; every rank skips that step, and the loss curve stays on the course of a run without it.

Runs three trainings on 2 gloo processes (a linear model, float16 compute, float32 masters, SGD):
``clean`` (the corrupted step left out on every rank), ``unguarded`` (rank 1's batch at step 30
has labels x10) and ``guarded`` (the same, with ``StepGuard(loss_zscore=5, grad_norm_zscore=5,
window=20)``), and prints, per step around the spike, each rank's decision and rank 0's loss in each run. Run:

    python tools/guard_ranks.py
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import numpy as np

STEPS, SPIKE = 60, (30, 1)  # (step, rank): rank 1 alone gets a corrupted batch


def train(rank: int, size: int, run: str) -> dict:
    import torch.distributed as dist

    from polyamp import LossScaleConfig, MixedPrecisionTrainer, Parameter, StepGuard
    from polyamp.distributed import reducer
    from polyamp.optim import SGD

    class Linear:
        def __init__(self) -> None:
            self.w = Parameter(np.full((4, 1), 0.1, np.float32))

        def parameters(self):
            return [self.w]

        def forward(self, x, compute_dtype):
            self.x = x.astype(np.float32)
            return (self.x @ self.w.data).astype(compute_dtype)

        def backward(self, grad_output):
            self.w.grad[...] = self.x.T @ grad_output.astype(np.float32)

    def mse(output, target):
        err = output.astype(np.float32) - target
        return np.mean(err * err), 2 * err / err.size

    model, red = Linear(), reducer("torch")
    guard = StepGuard(loss_zscore=5.0, grad_norm_zscore=5.0, window=20, min_history=10)
    trainer = MixedPrecisionTrainer(model, SGD(model.parameters(), lr=0.05), "float16",
                                    LossScaleConfig(init_scale=2.0**4, growth_interval=7), reducer=red,
                                    guard=guard if run == "guarded" else None)
    out: dict = {"reason": [], "loss": [], "collectives": []}
    for step in range(STEPS):
        rng = np.random.default_rng(step * 10 + rank)
        x = rng.standard_normal((8, 4)).astype(np.float32)
        y = rng.standard_normal((8, 1)).astype(np.float32)
        if (step, rank) == SPIKE and run != "clean":
            y = y * 10
        if step == SPIKE[0] and run == "clean":  # the step left out on every rank
            out["reason"].append("(left out)")
            out["loss"].append(None)
            out["collectives"].append(0)
            continue
        before = red.collectives
        metrics = trainer.train_step(x, y, mse)
        out["collectives"].append(red.collectives - before)
        out["reason"].append(metrics.reason if metrics.skipped else "applied")
        loss = np.asarray([metrics.loss], np.float64)
        out["loss"].append(float(loss[0]))
    out["w"] = model.w.data.ravel().tolist()
    dist.barrier()
    return out


def _worker(rank: int, size: int, port: int, run: str, queue) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size,
                            timeout=timedelta(seconds=60))
    try:
        queue.put((rank, train(rank, size, run)))
    finally:
        dist.destroy_process_group()


def run_ranks(run: str, size: int = 2) -> list[dict]:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, size, port, run, queue)) for r in range(size)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=120) for _ in procs)
    for p in procs:
        p.join()
    return [results[r] for r in range(size)]


def main() -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    runs = {name: run_ranks(name) for name in ("clean", "unguarded", "guarded")}
    g0, g1 = runs["guarded"]
    print("step | guarded rank 0      | guarded rank 1      | loss clean | loss unguarded | loss guarded")
    for step in range(STEPS):
        if step < 26 or step > 36 and step < STEPS - 3:
            continue
        def fmt(v):
            return "      -" if v is None else f"{v:10.4f}"
        print(f"{step:4d} | {g0['reason'][step]:19s} | {g1['reason'][step]:19s} | "
              f"{fmt(runs['clean'][0]['loss'][step])} | {fmt(runs['unguarded'][0]['loss'][step]):>14s} | "
              f"{fmt(g0['loss'][step])}")
    same = g0["reason"] == g1["reason"]
    print(f"decisions equal on both ranks: {same}; skipped steps (guarded): "
          f"{[s for s, r in enumerate(g0['reason']) if r != 'applied']}")
    print(f"collectives per step (guarded, rank 0): first {g0['collectives'][0]}, then "
          f"{sorted(set(g0['collectives'][1:]))}")
    kept = [v for s, v in enumerate(g0["loss"]) if s != SPIKE[0]]
    clean = [v for s, v in enumerate(runs["clean"][0]["loss"]) if s != SPIKE[0]]
    print(f"guarded loss curve equal to the clean run's (the spike step left out): {kept == clean}")
    print(f"final weights  clean {np.round(runs['clean'][0]['w'], 5).tolist()}")
    print(f"           unguarded {np.round(runs['unguarded'][0]['w'], 5).tolist()}")
    print(f"             guarded {np.round(g0['w'], 5).tolist()} (rank 1: {np.round(g1['w'], 5).tolist()})")


if __name__ == "__main__":
    main()
