"""Review of StepGuard across ranks (real gloo, 2 processes): ranks whose guards are configured
differently, or where one rank gives a loss and the other not, must raise RankMismatchError on
every rank before any rank applies a step (as a differing LossScaleConfig does)."""

from __future__ import annotations

import numpy as np
import pytest

STEPS = 12


def differing_run(rank: int, size: int, case: str) -> dict:
    from polyamp import LossScaleConfig, LossScaler, StepGuard
    from polyamp.distributed import reducer

    red = reducer("torch")
    guards = {  # rank 0's guard, rank 1's guard
        "threshold": (StepGuard(loss_zscore=3.0, window=10, min_history=5),
                      StepGuard(loss_zscore=1000.0, window=10, min_history=5)),
        "window": (StepGuard(loss_zscore=3.0, window=10, min_history=5),
                   StepGuard(loss_zscore=3.0, window=20, min_history=5)),
        "on_streak": (StepGuard(max_grad_norm=1e9, max_consecutive_skips=2, on_streak="raise"),
                      StepGuard(max_grad_norm=1e9, max_consecutive_skips=2, on_streak="warn")),
        "loss_on_one_rank": (StepGuard(max_grad_norm=1e9), StepGuard(max_grad_norm=1e9)),
        "same": (StepGuard(loss_zscore=3.0, window=10, min_history=5, on_streak=lambda report: None),
                 StepGuard(loss_zscore=3.0, window=10, min_history=5, on_streak=print)),
        "hook_or_raise": (StepGuard(loss_zscore=3.0, window=10, min_history=5),
                          StepGuard(loss_zscore=3.0, window=10, min_history=5, on_streak=print)),
    }[case]
    scaler = LossScaler(LossScaleConfig(init_scale=1.0, dynamic=False), reducer=red, guard=guards[rank])
    applied: list[int] = []
    for step in range(STEPS):
        loss = 1.0 + 0.01 * (step % 3) + (100.0 if step == STEPS - 1 else 0.0)
        if case == "loss_on_one_rank" and rank == 1:
            loss = None
        try:
            scaler.step([np.ones(2, np.float32)], lambda step=step: applied.append(step), loss=loss)
            scaler.update()
        except Exception as exc:  # noqa: BLE001 - reported per rank
            return {"error": f"{type(exc).__name__}: {exc}", "applied": applied, "step": step}
    return {"error": None, "applied": applied, "step": STEPS}


@pytest.mark.parametrize("case", ["threshold", "window", "on_streak", "hook_or_raise",
                                  "loss_on_one_rank"])
def test_differently_configured_guards_raise_on_every_rank_before_any_step(run_gloo, case):
    results = run_gloo(differing_run, 2, case).results()
    for rank, out in enumerate(results):
        assert (out["error"] or "").startswith("RankMismatchError"), (rank, out)
        assert out["step"] == 0 and out["applied"] == [], (rank, out)


def test_guards_that_differ_only_in_the_hook_object_agree(run_gloo):
    results = run_gloo(differing_run, 2, "same").results()
    for out in results:
        assert out["error"] is None and out["applied"] == list(range(STEPS - 1)), out


def trainer_differing_run(rank: int, size: int, case: str) -> dict:
    from polyamp import LossScaleConfig, MixedPrecisionTrainer, StepGuard
    from polyamp.distributed import reducer
    from polyamp.optim import SGD
    from polyamp.parameter import Parameter

    class Linear:
        def __init__(self):
            self.w = Parameter(np.full((4, 1), 0.1, np.float32))

        def parameters(self):
            return [self.w]

        def forward(self, x, compute_dtype):
            self.x = x
            return (x @ self.w.data).astype(compute_dtype)

        def backward(self, grad_output):
            self.w.grad[...] = self.x.T @ grad_output.astype(np.float32)

    def mse(output, target):
        err = output.astype(np.float32) - target
        return np.mean(err * err), 2 * err / err.size

    guard = StepGuard(loss_zscore=3.0 if rank == 0 or case != "threshold" else 1000.0, window=10,
                      min_history=5)
    model = Linear()
    trainer = MixedPrecisionTrainer(model, SGD(model.parameters(), lr=0.05), "float16",
                                    LossScaleConfig(init_scale=2.0**4), reducer=reducer("torch"), guard=guard)
    if case == "history" and rank == 1:  # rank 1 resumed from another checkpoint: another history
        trainer.scaler.load_state_dict({**trainer.scaler.state_dict(),
                                        "guard": {"loss": [1.0, 2.0], "grad_norm": [], "streak": 0,
                                                  "reasons": []}})
    reasons = []
    for step in range(STEPS):
        x = np.random.default_rng(step * 10 + rank).standard_normal((8, 4)).astype(np.float32)
        try:
            reasons.append(trainer.train_step(x, np.ones((8, 1), np.float32), mse).reason)
        except Exception as exc:  # noqa: BLE001 - reported per rank
            return {"error": f"{type(exc).__name__}: {exc}", "step": step, "w": model.w.data.tolist()}
    return {"error": None, "step": STEPS, "reasons": reasons}


@pytest.mark.parametrize("case", ["threshold", "history"])
def test_the_data_parallel_trainer_refuses_differing_guards_on_every_rank(run_gloo, case):
    results = run_gloo(trainer_differing_run, 2, case).results()
    for rank, out in enumerate(results):
        assert (out["error"] or "").startswith("RankMismatchError"), (rank, out)
        assert out["step"] == 0 and out["w"] == [[float(np.float32(0.1))]] * 4, (rank, out)  # none applied
