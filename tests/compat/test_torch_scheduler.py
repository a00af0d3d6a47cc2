"""GradScaler.step_scheduler: an LR scheduler steps only after applied optimizer steps."""

from __future__ import annotations

import math
import warnings

import pytest

torch = pytest.importorskip("torch")

from polyamp.compat.torch import GradScaler  # noqa: E402

from polyamp import schedule  # noqa: E402

ORDER_WARNING = "Detected call of `lr_scheduler.step()` before `optimizer.step()`"


def training(cls, overflow_at, use_helper, steps=4):
    """Run ``steps`` iterations; return the learning rates seen and the warnings raised."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    scaler = cls("cpu", init_scale=2.0**8)
    lrs = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(steps):
            opt.zero_grad()
            loss = model(torch.ones(1, 3)).sum() * (math.inf if step in overflow_at else 1.0)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            if use_helper:
                scaler.step_scheduler(sched)
            else:
                sched.step()
            lrs.append(opt.param_groups[0]["lr"])
    return lrs, [str(w.message) for w in caught]


def order_warnings(messages):
    return [m for m in messages if ORDER_WARNING in m]


@pytest.mark.parametrize("cls", [torch.amp.GradScaler, GradScaler], ids=["torch", "polyamp"])
def test_torchs_pattern_warns_when_the_first_step_is_skipped(cls):
    lrs, messages = training(cls, overflow_at={0}, use_helper=False)
    assert len(order_warnings(messages)) == 1
    assert lrs == [0.5, 0.25, 0.125, 0.0625]  # the schedule advanced on the skipped step too


def test_step_scheduler_does_not_warn_and_skips_with_the_step():
    lrs, messages = training(GradScaler, overflow_at={0, 2}, use_helper=True)
    assert order_warnings(messages) == []
    assert lrs == [1.0, 0.5, 0.5, 0.25]  # advanced only after applied steps


def test_step_scheduler_returns_whether_it_stepped():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    scaler = GradScaler("cpu")
    for overflow, stepped in ((True, False), (False, True)):
        opt.zero_grad()
        scaler.scale(model(torch.ones(1, 3)).sum() * (math.inf if overflow else 1.0)).backward()
        scaler.step(opt)
        scaler.update()
        assert scaler.last_step_skipped is overflow
        assert scaler.step_scheduler(sched) is stepped
    assert sched.last_epoch == 1


def test_disabled_scaler_always_steps_the_scheduler():
    lrs, messages = training(GradScaler, overflow_at=set(), use_helper=True)
    disabled = GradScaler("cpu", enabled=False)
    opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    opt.step()
    assert disabled.step_scheduler(sched) is True and opt.param_groups[0]["lr"] == 0.5
    assert lrs == [0.5, 0.25, 0.125, 0.0625] and order_warnings(messages) == []


def test_step_if_applied_passes_arguments_through():
    class Recorder:
        def __init__(self):
            self.calls = []

        def step(self, *args, **kwargs):
            self.calls.append((args, kwargs))

    rec = Recorder()
    assert schedule.step_if_applied(rec, True, 1.0) is False and rec.calls == []
    assert schedule.step_if_applied(rec, False, 0.5, epoch=3) is True
    assert schedule.step_if_applied(rec, None) is True
    assert rec.calls == [((0.5,), {"epoch": 3}), ((), {})]
