"""Regression tests for the adversarial review of "The step as one decision" (branch h-attack).

Each test fails on the code it was written against and is marked xfail(strict=True) until fixed.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

from polyamp import LossScaler, StepGuard

GUARD = dict(loss_zscore=3.0, window=8, min_history=4)


# -- F1: a loss refused after the gradients were unscaled leaves the iteration open ---------------
@pytest.mark.xfail(strict=True, reason="F1: step(loss=10**400) unscales, then raises OverflowError and "
                   "leaves unscaled=True: the next step applies its gradients still scaled")
@pytest.mark.parametrize("loss", [10**400, np.array("a")], ids=["huge-int", "str-array"])
def test_f1_bad_loss_is_refused_before_the_gradients_change(loss):
    scaler = LossScaler(backend="numpy", guard=StepGuard(**GUARD))
    grad = np.full(3, 4.0, np.float32)
    with pytest.raises((TypeError, ValueError)):
        scaler.step([grad], lambda: None, loss=loss)
    assert np.array_equal(grad, np.full(3, 4.0, np.float32))  # a failed call changes no state
    scaled = np.full(3, 65536.0, np.float32)
    applied = []
    scaler.step([scaled], lambda: applied.append(scaled.copy()), loss=1.0)
    scaler.update()
    assert applied and np.array_equal(applied[0], np.ones(3, np.float32))  # unscaled before the step


# -- F2: the torch facade's refused update(new_scale=...) half-ends the iteration ----------------
def _torch_loop(guard=None):
    torch = pytest.importorskip("torch")
    import polyamp

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = polyamp.GradScaler("cpu", init_scale=4.0, guard=guard)

    def forward_backward():
        opt.zero_grad()
        loss = model(torch.ones(1, 3)).sum()
        scaler.scale(loss).backward()
        return loss.item()

    return torch, model, opt, scaler, forward_backward


@pytest.mark.xfail(strict=True, reason="F2: update(new_scale='x') clears the facade's records but leaves "
                   "the engine's iteration open: its loss is summed into the next step's, which the guard "
                   "judges and records")
def test_f2_refused_new_scale_leaves_no_half_open_iteration():
    torch, model, opt, scaler, forward_backward = _torch_loop(StepGuard(**GUARD))
    forward_backward()
    scaler.step(opt)
    with pytest.raises(TypeError, match="new_scale"):
        scaler.update(new_scale="x")
    with contextlib.suppress(AssertionError):  # either design: a retry ends it, or it had ended
        scaler.update()
    loss = forward_backward()
    scaler.step(opt)
    scaler.update()
    assert scaler._iteration.histories[0].loss[-1] == pytest.approx(loss)  # this step's loss, alone
