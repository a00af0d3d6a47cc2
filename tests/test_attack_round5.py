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


# -- 2: a flag of no real dtype was kept, then every step unscaled the gradients and raised --------
def _bad_flags():
    torch = pytest.importorskip("torch")
    return [("numpy", np.array("a")), ("numpy", np.array(1 + 1j)), ("numpy", np.array(None)),
            ("torch", torch.tensor(1 + 1j)), ("torch", torch.empty((), device="meta"))]


@pytest.mark.parametrize("case", range(5))
def test_a_flag_of_no_real_dtype_is_refused_and_the_scaler_stays_usable(case):
    backend, flag = _bad_flags()[case]
    xp = __import__(backend)
    scaler = LossScaler(backend=backend, init_scale=8.0)
    grad = xp.full((3,), 8.0) if backend == "numpy" else xp.full((3,), 8.0)
    scaler.bind(grad)
    with pytest.raises(TypeError, match="flag"):
        scaler.record_found_inf(flag)
    with pytest.raises(TypeError, match="found_inf"):
        scaler.update(found_inf=flag)
    assert not scaler.has_pending_check  # nothing kept
    applied = []
    assert scaler.step([grad], lambda: applied.append(1)).applied
    scaler.update()
    assert applied == [1] and float(grad[0]) == 1.0  # unscaled once


# -- 3: a StepGuard on some ranks only was explained as a clip on some ranks only ------------------
def test_the_fix_of_differing_extra_values_names_the_guard_too():
    from polyamp._agreement import _fix

    words = _fix("rank states differ: 2 extra values agreed (e.g. a global-norm clip's sum of squares)")
    assert "clip" in words and "StepGuard" in words
