"""Regression tests for the adversarial review of issue 31's step (round 5), on real ranks.

Each test failed on the code it was written against; each passes since its fix.
"""

from __future__ import annotations

import numpy as np
import pytest

STEPS = 3


def lengths_run(rank: int, size: int, group: str, case: str) -> dict:
    """A guarded engine whose message length changes on one rank only after the first step (a clip's
    two values added on the last rank, or dropped there): every rank must raise RankMismatchError."""
    from polyamp import LossScaleConfig, LossScaler, StepGuard, global_norm
    from polyamp.distributed import reducer

    guard = StepGuard(loss_zscore=3.0, window=10, min_history=5) if case.startswith("guarded") else None
    scaler = LossScaler(LossScaleConfig(init_scale=1.0, dynamic=False), reducer=reducer(group), guard=guard)
    applied: list[int] = []
    for step in range(STEPS):
        grads = [np.full(3, 1.0 + rank, np.float32)]
        odd = rank == size - 1 and step >= 1
        clip = (not odd) if case.endswith("drop") else odd
        try:
            scaler.unscale_(grads, loss=1.0 if guard is not None else None)
            if clip:
                global_norm(grads, scaler=scaler)  # agree_(extra=...): two values more
            scaler.step(grads, lambda step=step: applied.append(step))
            scaler.update()
        except Exception as exc:  # noqa: BLE001 - reported per rank
            return {"error": f"{type(exc).__name__}: {exc}", "applied": applied, "step": step}
    return {"error": None, "applied": applied, "step": STEPS}


LENGTHS = ["guarded-add", "guarded-drop", "plain-drop"]


def _every_rank_raised_at_step_1(job) -> None:
    assert not job.timed_out, job.output[-3000:]
    results = job.results()
    for rank, out in enumerate(results):
        assert (out["error"] or "").startswith("RankMismatchError"), (rank, out)
        assert out["step"] == 1 and out["applied"] == [0], (rank, out)


@pytest.mark.parametrize("case", LENGTHS)
def test_a_length_changed_on_one_rank_after_the_first_step_raises_on_gloo(run_gloo, case):
    _every_rank_raised_at_step_1(run_gloo(lengths_run, 3, "torch", case, timeout=60))


@pytest.mark.parametrize("case", LENGTHS)
def test_a_length_changed_on_one_rank_after_the_first_step_raises_under_mpi(run_mpi, case):
    _every_rank_raised_at_step_1(run_mpi(lengths_run, 3, "mpi", case, timeout=60))
