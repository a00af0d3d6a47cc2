"""Ranks that are not aligned never diverge silently: every rank raises, nothing is applied alone.

Each case runs on real gloo process groups and under mpirun: a different number of collectives
per iteration (ShardedGradScaler, one rank stepping two optimizers), a different scaler state
(a checkpoint with another scale, or another config after the first step; also through the
data-parallel trainer), two scalers sharing one group on one rank, and a late rank (on_fault).
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

STEPS = 4


def _outcome(fn) -> dict:
    """Run ``fn()``; report the error's type and message instead of raising."""
    try:
        return {"value": fn(), "type": None, "message": ""}
    except Exception as exc:  # the job reports it per rank
        return {"value": None, "type": type(exc).__name__, "message": str(exc)}


# -- 1. a rank that issues more collectives per iteration -------------------------------------
def two_optimizers_on_one_rank(rank: int, size: int, group: str) -> dict:
    """ShardedGradScaler: rank 0 steps two optimizers per iteration, the others one."""
    import torch
    from polyamp.compat.torch import ShardedGradScaler

    scaler = ShardedGradScaler("cpu", init_scale=4.0, process_group=None if group == "torch" else group)
    params = [torch.nn.Parameter(torch.ones(3)) for _ in range(2)]
    optimizers = [torch.optim.SGD([p], lr=0.5) for p in params]
    mine = optimizers if rank == 0 else optimizers[:1]
    applied: list[tuple[int, int]] = []

    def train() -> None:
        for it in range(STEPS):
            scaler.scale(torch.ones(()))  # the state exists from the first scale, as in torch
            for i, opt in enumerate(mine):
                params[i].grad = torch.full((3,), 4.0)
                before = params[i].detach().clone()
                scaler.step(opt)
                if not torch.equal(before, params[i].detach()):
                    applied.append((it, i))
            scaler.update()

    out = _outcome(train)
    out["applied"] = applied
    return out


def check_two_optimizers(results: list[dict]) -> None:
    for rank, out in enumerate(results):
        assert out["type"] == "RankMismatchError", (rank, out)
        assert "collectives are not aligned" in out["message"], out["message"]
        message = out["message"]
        assert "collective 2 of iteration 0" in message or "collective 1 of iteration 1" in message
        assert "step (or unscale_) the same optimizers on every rank" in out["message"]
        # iteration 0's first optimizer agreed everywhere; nothing after it was applied anywhere
        assert out["applied"] == [(0, 0)], (rank, out["applied"])


def test_more_collectives_on_one_rank_raise_everywhere_gloo(run_gloo):
    check_two_optimizers(run_gloo(two_optimizers_on_one_rank, 2, "torch").results())


def test_more_collectives_on_one_rank_raise_everywhere_mpi(run_mpi):
    check_two_optimizers(run_mpi(two_optimizers_on_one_rank, 3, "mpi").results())


# -- 2. a rank whose scaler state or config differs ---------------------------------------------
def state_differs(rank: int, size: int, group: str, what: str) -> dict:
    """Every rank steps a LossScaler; the last rank loads another state after step 1."""
    from polyamp import LossScaleConfig, LossScaler

    config = LossScaleConfig(init_scale=2.0**16, growth_interval=100)
    scaler = LossScaler(config, reducer=group)
    applied: list[int] = []

    def train() -> None:
        for step in range(STEPS):
            if step == 1 and rank == size - 1:
                state = scaler.state_dict()
                if what == "scale":
                    state["scale"] = 2.0**10
                else:  # a config checkpoint taken elsewhere: another growth_interval
                    state["config"]["growth_interval"] = 50
                scaler.load_state_dict(state)
            scaler.step([np.full(3, 2.0, np.float32)], lambda step=step: applied.append(step))
            scaler.update()

    out = _outcome(train)
    out["applied"] = applied
    return out


def check_state_differs(results: list[dict], what: str) -> None:
    size = len(results)
    for rank, out in enumerate(results):
        assert out["type"] == "RankMismatchError", (rank, out)
        assert out["applied"] == [0], (rank, out["applied"])  # step 1 reached no rank's weights
        message = out["message"]
        if what == "config":
            assert "config fingerprint" in message and "same config on every rank" in message
        elif rank == size - 1:
            assert "rank states differ: scale 2**10 on this rank, scale 2**16 on the other ranks" in message
        elif size == 2:
            assert "rank states differ: scale 2**16 on this rank, scale 2**10 on the other ranks" in message
        else:
            assert "scale 2**16 on this rank, another value on at least one other rank" in message
        if what == "scale":
            assert "load the same checkpoint on every rank" in message


@pytest.mark.parametrize("what", ["scale", "config"])
def test_a_rank_with_another_state_raises_everywhere_gloo(run_gloo, what):
    check_state_differs(run_gloo(state_differs, 2, "torch", what).results(), what)


@pytest.mark.parametrize("what", ["scale", "config"])
def test_a_rank_with_another_state_raises_everywhere_mpi(run_mpi, what):
    check_state_differs(run_mpi(state_differs, 3, "mpi", what).results(), what)


def trainer_state_differs(rank: int, size: int, group: str) -> dict:
    """The data-parallel trainer: the last rank loads another scale after two steps."""
    from polyamp import LossScaleConfig, MixedPrecisionTrainer
    from polyamp.demo.mlp import MLP
    from polyamp.optim import SGD

    rng = np.random.default_rng(0)
    x = rng.standard_normal((16, 4)).astype(np.float32)
    y = rng.integers(0, 3, 16)
    model = MLP([4, 8, 3], seed=0)
    trainer = MixedPrecisionTrainer(model, SGD(model.parameters(), lr=0.1), "float16",
                                    LossScaleConfig(init_scale=2.0**8), reducer=group)
    from polyamp.demo.mlp import softmax_cross_entropy

    shard = slice(rank * 16 // size, (rank + 1) * 16 // size)
    masters: list[np.ndarray] = []

    def train() -> None:
        for step in range(STEPS):
            if step == 2 and rank == size - 1:
                trainer.scaler.set_scale(2.0**4)
            trainer.train_step(x[shard], y[shard], softmax_cross_entropy)
            masters.append(np.concatenate([p.data.reshape(-1) for p in model.parameters()]))

    out = _outcome(train)
    out["masters"] = masters
    return out


def check_trainer(results: list[dict]) -> None:
    for rank, out in enumerate(results):
        assert out["type"] == "RankMismatchError", (rank, out)
        assert "rank states differ: scale" in out["message"]
        assert len(out["masters"]) == 2  # the third step reached no rank
    for out in results[1:]:  # the masters never drifted apart
        for mine, first in zip(out["masters"], results[0]["masters"]):
            np.testing.assert_array_equal(mine, first)


def test_the_trainer_stops_before_masters_drift_gloo(run_gloo):
    check_trainer(run_gloo(trainer_state_differs, 2, "torch").results())


def test_the_trainer_stops_before_masters_drift_mpi(run_mpi):
    check_trainer(run_mpi(trainer_state_differs, 2, "mpi").results())


# -- 3. two scalers sharing one group on one rank (gloo used to abort the other process) -------
def two_scalers_on_one_rank(rank: int, size: int, group: str) -> dict:
    from polyamp import LossScaler
    from polyamp.distributed import reducer

    red = reducer(group)
    scalers = [LossScaler(reducer=red)] + ([LossScaler(reducer=red)] if rank == 0 else [])
    applied: list[tuple[int, int]] = []

    def train() -> None:
        for step in range(STEPS):
            for i, scaler in enumerate(scalers):
                scaler.step([np.ones(2, np.float32)], lambda i=i, step=step: applied.append((step, i)))
                scaler.update()

    out = _outcome(train)
    out["applied"] = applied
    return out


def check_two_scalers(job) -> None:
    assert not job.timed_out
    for rank, out in enumerate(job.results()):  # every process lived to report
        assert out["type"] == "RankMismatchError", (rank, out)
        assert "collectives are not aligned" in out["message"]
        assert out["applied"] == [(0, 0)], out["applied"]


def test_two_scalers_on_one_group_raise_instead_of_aborting_gloo(run_gloo):
    check_two_scalers(run_gloo(two_scalers_on_one_rank, 2, "torch"))


def test_two_scalers_on_one_group_raise_everywhere_mpi(run_mpi):
    check_two_scalers(run_mpi(two_scalers_on_one_rank, 3, "mpi"))


# -- 4. a late rank: no rank completes the abandoned step on its own ---------------------------
LATE_STEP = 2


def late_rank(rank: int, size: int, group: str, marks: str, on_fault: str) -> dict:
    """The last rank sleeps past the timeout before step LATE_STEP; each rank logs its steps."""
    from polyamp import LossScaler
    from polyamp.distributed import reducer

    scaler = LossScaler(reducer=reducer(group, timeout=1.0, on_fault=on_fault))
    log = Path(marks, f"applied-{rank}")

    def apply(step: int) -> None:
        with open(log, "a") as f:
            f.write(f"{step}\n")

    def train() -> None:
        for step in range(STEPS + 2):
            if step == LATE_STEP and rank == size - 1:
                time.sleep(4.0)
            scaler.step([np.ones(2, np.float32)], lambda step=step: apply(step))
            scaler.update()

    return _outcome(train)


def _applied(marks: Path, rank: int) -> list[int]:
    path = marks / f"applied-{rank}"
    return [int(v) for v in path.read_text().split()] if path.exists() else []


def test_a_late_rank_cannot_apply_the_abandoned_step_mpi(run_mpi, tmp_path):
    job = run_mpi(late_rank, 3, "mpi", str(tmp_path), "abort", timeout=60)
    assert not job.timed_out and job.returncode != 0  # MPI_Abort ended the job
    assert "ending the job (on_fault='abort')" in job.output and "ReducerTimeoutError" in job.output
    for rank in range(3):
        assert _applied(tmp_path, rank) == list(range(LATE_STEP)), rank


def test_a_late_rank_cannot_apply_the_abandoned_step_gloo(run_gloo, tmp_path):
    job = run_gloo(late_rank, 3, "torch", str(tmp_path), "abort", pg_timeout=30.0, timeout=60)
    assert not job.timed_out
    for rank in range(3):
        assert _applied(tmp_path, rank) == list(range(LATE_STEP)), rank
    early = [r for r in job.ranks[:2] if r.finished]
    assert early and all(r.value["type"] == "ReducerTimeoutError" for r in early), job.output[-3000:]
    late = job.ranks[2]
    assert not late.finished or late.value["type"] in ("ReducerError", "ReducerTimeoutError"), late


def test_on_fault_raise_only_raises_mpi(run_mpi, tmp_path):
    """With on_fault="raise" the ranks that timed out raise and the job goes on (the user's risk)."""
    job = run_mpi(late_rank, 2, "mpi", str(tmp_path), "raise", timeout=60)
    out = job.ranks[0].result()
    assert out["type"] == "ReducerTimeoutError" and _applied(tmp_path, 0) == list(range(LATE_STEP))
