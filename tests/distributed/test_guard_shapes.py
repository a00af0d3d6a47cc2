"""Ranks whose messages would differ in length (issue 32, item 5): a StepGuard on some ranks only, a
norm rule on one rank and a loss-only guard on the others, a clip's extra values on one rank only.
Their messages met in collectives of different sizes, and the transport aborted the job (gloo
SIGABRT, MPI_ERR_TRUNCATE). The first message of a new length is announced first, in the fixed-size
one-value message whose fingerprint names it: every rank raises RankMismatchError before any rank
applies. Real gloo ranks (3) and ``mpirun -n 3``; the ranks whose shapes agree are shown to train.
"""

from __future__ import annotations

import numpy as np
import pytest

STEPS = 4


def shaped_run(rank: int, size: int, group: str, case: str) -> dict:
    from polyamp import LossScaleConfig, LossScaler, StepGuard, global_norm
    from polyamp.distributed import reducer

    norm_and_loss = StepGuard(max_grad_norm=1e9, loss_zscore=3.0, window=10, min_history=5)
    loss_only = StepGuard(loss_zscore=3.0, window=10, min_history=5)
    guard = {
        "guard_on_one_rank": norm_and_loss if rank == 0 else None,
        "norm_on_one_rank": norm_and_loss if rank == 0 else loss_only,
        "same": norm_and_loss,
        "clip_on_one_rank": None,
    }[case]
    scaler = LossScaler(LossScaleConfig(init_scale=1.0, dynamic=False), reducer=reducer(group), guard=guard)
    applied: list[int] = []
    collectives = []
    for step in range(STEPS):
        grads = [np.full(3, 1.0 + rank, np.float32)]
        try:
            scaler.unscale_(grads)
            if case == "clip_on_one_rank" and rank == size - 1:
                global_norm(grads, scaler=scaler)  # agree_(extra=...): two values more on this rank only
            scaler.step(grads, lambda step=step: applied.append(step), loss=1.0)
            scaler.update()
        except Exception as exc:  # noqa: BLE001 - reported per rank
            return {"error": f"{type(exc).__name__}: {exc}", "applied": applied, "step": step}
        collectives.append(scaler.reducer.collectives)
    return {"error": None, "applied": applied, "step": STEPS, "collectives": collectives}


def _mismatch(results: list[dict]) -> None:
    assert len(results) == 3
    for rank, out in enumerate(results):
        assert (out["error"] or "").startswith("RankMismatchError"), (rank, out)
        assert "extra values agreed" in out["error"] or "the flag of scaler/optimizer" in out["error"], out
        assert out["step"] == 0 and out["applied"] == [], (rank, out)  # found before any rank applied


CASES = ["guard_on_one_rank", "norm_on_one_rank", "clip_on_one_rank"]


@pytest.mark.parametrize("case", CASES)
def test_messages_of_different_lengths_raise_on_every_rank_on_gloo(run_gloo, case):
    _mismatch(run_gloo(shaped_run, 3, "torch", case).results())


@pytest.mark.parametrize("case", CASES)
def test_messages_of_different_lengths_raise_on_every_rank_under_mpi(run_mpi, case):
    _mismatch(run_mpi(shaped_run, 3, "mpi", case).results())


def test_guards_of_one_shape_train_with_one_announcement(run_gloo):
    results = run_gloo(shaped_run, 3, "torch", "same").results()
    for out in results:
        assert out["error"] is None and out["applied"] == list(range(STEPS)), out
        # the first step announces the guard's length once (two collectives), then one per step
        assert np.diff([0, *out["collectives"]]).tolist() == [2] + [1] * (STEPS - 1), out
