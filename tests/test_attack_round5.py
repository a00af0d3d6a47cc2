"""Regression tests for the adversarial review of issue 31's step (round 5), in one process.

Each test failed on the code it was written against; each passes since its fix.
"""

from __future__ import annotations

import numpy as np
import pytest

from polyamp import LossScaler, StepGuard

GUARD = dict(loss_zscore=3.0, window=8, min_history=4)


# -- 1: the engine's step retried after step_fn raised, with the same loss= -----------------------
def test_engine_step_retried_with_its_loss_after_step_fn_raised():
    scaler = LossScaler(backend="numpy", init_scale=4.0, guard=StepGuard(**GUARD))
    grad = np.full(3, 4.0, np.float32)
    failures, applied = [1], []

    def flaky():
        if failures:
            failures.pop()
            raise RuntimeError("transient")
        applied.append(grad.copy())

    with pytest.raises(RuntimeError, match="transient"):
        scaler.step([grad], flaky, loss=2.0)
    result = scaler.step([grad], flaky, loss=2.0)  # the same call again: the retry the engine allows
    scaler.update()
    assert result.applied and len(applied) == 1 and np.array_equal(applied[0], np.ones(3, np.float32))
    assert scaler.guard_history.loss == (2.0,)  # the loss taken once, the step recorded once
    assert (scaler.steps, scaler.skipped_steps) == (1, 0)
    # the loss given to unscale_() and again to step() is still refused
    scaler.unscale_([np.ones(3, np.float32)], loss=1.0)
    with pytest.raises(Exception, match="not both"):
        scaler.step([grad], lambda: None, loss=1.0)
