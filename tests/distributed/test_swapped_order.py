"""Optimizers (or scalers) stepped in another order on one rank are found on every rank, before any
rank applies a step (gloo and MPI): each agreement carries whose flag it is.

The sharded facade names an optimizer by what every rank of a sharded job shares, whatever its shard
holds: its place in the order first stepped, its class, DTensors' global shapes (uneven shards:
test_sharded_uneven.py); two scalers on one group are told apart by the order in which the process
built them. Two optimizers of one class over plain tensors, swapped from their first step, cannot be
told apart (docs/distributed.md).
"""

from __future__ import annotations

import numpy as np


def _outcome(fn) -> dict:
    try:
        return {"value": fn(), "type": None, "message": ""}
    except Exception as exc:  # the job reports it per rank
        return {"value": None, "type": type(exc).__name__, "message": str(exc)}


def swapped_optimizers(rank: int, size: int, group: str) -> dict:
    """ShardedGradScaler with optimizers A (SGD, two parameters) and B (Adam, one); rank 1 steps B first."""
    import torch
    from polyamp.compat.torch import ShardedGradScaler

    scaler = ShardedGradScaler("cpu", init_scale=2.0**10, growth_interval=3,
                               process_group=None if group == "torch" else group)
    wa = [torch.nn.Parameter(torch.ones(3)) for _ in range(2)]
    wb = torch.nn.Parameter(torch.ones(3))
    oa, ob = torch.optim.SGD(wa, lr=0.1), torch.optim.Adam([wb], lr=0.1)
    order = [("B", ob, [wb]), ("A", oa, wa)] if rank == 1 else [("A", oa, wa), ("B", ob, [wb])]
    applied: list[tuple[int, str]] = []

    def train() -> None:
        for it in range(4):
            bad = rank == 1 and it % 3 == 1
            loss = sum((w * (float("inf") if bad else 1.0)).sum() for w in wa) + (wb * 2.0).sum()
            scaler.scale(loss).backward()
            for name, opt, params in order:
                before = [p.detach().clone() for p in params]
                scaler.step(opt)
                if any(not torch.equal(b, p.detach()) for b, p in zip(before, params)):
                    applied.append((it, name))
            scaler.update()
            oa.zero_grad()
            ob.zero_grad()

    out = _outcome(train)
    out["applied"] = applied
    return out


def swapped_scalers(rank: int, size: int, group: str) -> dict:
    """Two LossScalers on one group; rank 1 steps the second before the first."""
    from polyamp import LossScaler

    first, second = LossScaler(init_scale=8.0, reducer=group), LossScaler(init_scale=8.0, reducer=group)
    pairs = [("second", second), ("first", first)] if rank == 1 else [("first", first), ("second", second)]
    applied: list[tuple[int, str]] = []

    def train() -> None:
        for it in range(3):
            for name, scaler in pairs:
                record = lambda it=it, name=name: applied.append((it, name))  # noqa: E731
                scaler.step([np.full(3, 2.0, np.float32)], record)
                scaler.update()

    out = _outcome(train)
    out["applied"] = applied
    return out


def check(results: list[dict]) -> None:
    for rank, out in enumerate(results):
        assert out["type"] == "RankMismatchError", (rank, out)
        assert out["applied"] == [], (rank, out["applied"])  # the first step reached no rank's weights
        assert "the flag of scaler/optimizer" in out["message"], out["message"]
        assert "same optimizers in the same order" in out["message"], out["message"]


def test_optimizers_stepped_in_another_order_raise_everywhere_gloo(run_gloo):
    check(run_gloo(swapped_optimizers, 2, "torch").results())


def test_optimizers_stepped_in_another_order_raise_everywhere_mpi(run_mpi):
    check(run_mpi(swapped_optimizers, 3, "mpi").results())


def test_scalers_stepped_in_another_order_raise_everywhere_gloo(run_gloo):
    check(run_gloo(swapped_scalers, 2, "torch").results())


def test_scalers_stepped_in_another_order_raise_everywhere_mpi(run_mpi):
    check(run_mpi(swapped_scalers, 3, "mpi").results())


def trainer_clips_on_one_rank(rank: int, size: int, group: str) -> dict:
    """The data-parallel trainer with max_grad_norm on the last rank only."""
    from polyamp import LossScaleConfig, MixedPrecisionTrainer
    from polyamp.demo.mlp import MLP, softmax_cross_entropy
    from polyamp.optim import SGD

    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((16, 4)).astype(np.float32), rng.integers(0, 3, 16)
    model = MLP([4, 8, 3], seed=0)
    clip = 0.5 if rank == size - 1 else None
    trainer = MixedPrecisionTrainer(model, SGD(model.parameters(), lr=0.1), "float16",
                                    LossScaleConfig(init_scale=2.0**8), max_grad_norm=clip, reducer=group)
    before = [p.data.copy() for p in model.parameters()]
    shard = slice(rank * 16 // size, (rank + 1) * 16 // size)
    out = _outcome(lambda: trainer.train_step(x[shard], y[shard], softmax_cross_entropy))
    out["unchanged"] = all(np.array_equal(b, p.data) for b, p in zip(before, model.parameters()))
    return out


def check_clip(results: list[dict]) -> None:
    for rank, out in enumerate(results):
        assert out["type"] == "RankMismatchError", (rank, out)
        assert out["unchanged"], rank  # no rank applied the step
        assert "the flag of scaler/optimizer" in out["message"], out["message"]


def test_a_trainer_that_clips_on_one_rank_raises_everywhere_gloo(run_gloo):
    check_clip(run_gloo(trainer_clips_on_one_rank, 2, "torch").results())


def test_a_trainer_that_clips_on_one_rank_raises_everywhere_mpi(run_mpi):
    check_clip(run_mpi(trainer_clips_on_one_rank, 3, "mpi").results())


def clips_alone(rank: int, size: int, group: str) -> dict:
    """LossScaler with a reducer; the last rank clips by the global norm (a longer agreement)."""
    from polyamp import LossScaler, clip_grad_norm_

    scaler = LossScaler(init_scale=8.0, reducer=group)
    grads = [np.full(3, 16.0, np.float32)]
    applied: list[int] = []

    def step() -> None:
        scaler.unscale_(grads)
        if rank == size - 1:
            clip_grad_norm_(grads, 1.0, scaler=scaler)
        scaler.step(grads, lambda: applied.append(0))
        scaler.update()

    out = _outcome(step)
    out["applied"] = applied
    return out


def check_clips_alone(job) -> None:
    """Messages of different lengths fail in the transport (docs/distributed.md): every rank ends
    with an error (or is ended), and none applies the step."""
    finished = [r for r in job.ranks if r.finished]  # a rank ended by the transport (SIGABRT) did not
    for outcome in finished:
        assert outcome.value["type"] is not None, (outcome.rank, outcome.value)  # it raised
        assert outcome.value["applied"] == [], (outcome.rank, outcome.value)  # and applied nothing


def test_a_rank_that_clips_alone_fails_everywhere_and_applies_nothing_gloo(run_gloo):
    check_clips_alone(run_gloo(clips_alone, 2, "torch", timeout=60))


def test_a_rank_that_clips_alone_fails_everywhere_and_applies_nothing_mpi(run_mpi):
    check_clips_alone(run_mpi(clips_alone, 3, "mpi", timeout=60))
