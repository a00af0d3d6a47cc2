"""The precision meter's sampling phase survives a checkpoint (issue 33): a scaler resumed from
``state_dict()`` samples at the steps, and reports what, an uninterrupted run does, on LossScaler and
on the torch facade (whose state dict gains ``"steps"`` only with a meter, so a meterless one stays
exactly torch's). A bad ``"steps"`` is refused naming it, the scaler unchanged."""

from __future__ import annotations

import json

import numpy as np
import pytest

import polyamp

EVERY, STEPS = 3, 8


def grads_at(step: int, scale: float) -> list[np.ndarray]:
    rng = np.random.default_rng(step)
    return [(rng.standard_normal(50) * 1e-7 * scale).astype(np.float32),
            (rng.standard_normal(20) * 1e-2 * scale).astype(np.float32)]


def engine_run(scaler: polyamp.LossScaler, steps: range) -> list:
    reports = []
    for step in steps:
        scaler.step(grads_at(step, scaler.get_scale()), lambda: None)
        scaler.update()
        reports.append(scaler.last_precision)
    return reports


@pytest.mark.parametrize("cut", [1, 2, 3, 4])
def test_a_loss_scaler_resumed_from_its_state_dict_samples_as_if_never_stopped(cut):
    meter = polyamp.PrecisionMeter(every=EVERY)
    build = lambda: polyamp.LossScaler(init_scale=2.0**8, growth_interval=2, meter=meter)  # noqa: E731
    whole = engine_run(build(), range(STEPS))
    first = build()
    engine_run(first, range(cut))
    resumed = build()
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))  # as a checkpoint file holds it
    assert resumed.steps == cut
    got = engine_run(resumed, range(cut, STEPS))
    for step, report in zip(range(cut, STEPS), got):
        if step < cut + (-cut % EVERY):  # no sample since the resume: no report yet
            assert report is None, step
        else:
            assert report == whole[step] and report.step == step - step % EVERY, step


torch = pytest.importorskip("torch")


def facade_run(scaler, steps: range) -> list:
    """Steps of one parameter pair stepped by SGD through the torch facade (gradients as grads_at)."""
    params = [torch.nn.Parameter(torch.zeros(50)), torch.nn.Parameter(torch.zeros(20))]
    opt = torch.optim.SGD(params, lr=1.0)
    reports = []
    for step in steps:
        scaler.scale(torch.ones(()))  # creates the scale state, as a backward pass would
        for p, g in zip(params, grads_at(step, scaler.get_scale())):
            p.grad = torch.from_numpy(g)
        scaler.step(opt)
        scaler.update()
        reports.append(scaler.last_precision)
    return reports


@pytest.mark.parametrize("cut", [1, 2, 3, 4])
def test_the_torch_facade_resumed_from_its_state_dict_samples_as_if_never_stopped(cut):
    from polyamp.compat.torch import GradScaler

    meter = polyamp.PrecisionMeter(every=EVERY)
    build = lambda: GradScaler("cpu", init_scale=2.0**8, growth_interval=2, meter=meter)  # noqa: E731
    whole = facade_run(build(), range(STEPS))
    first = build()
    facade_run(first, range(cut))
    state = first.state_dict()
    assert state["steps"] == cut
    resumed = build()
    resumed.load_state_dict(state)
    assert resumed.metrics()["steps"] == cut
    got = facade_run(resumed, range(cut, STEPS))
    for step, report in zip(range(cut, STEPS), got):
        if step < cut + (-cut % EVERY):
            assert report is None, step
        else:  # named by index in both runs (no name_parameters): the same report
            assert report == whole[step] and report.step == step - step % EVERY, step
    theirs = torch.amp.GradScaler("cpu")  # torch ignores the extra key
    theirs.load_state_dict(state)
    assert theirs.get_scale() == state["scale"]


def test_a_meterless_facade_writes_no_steps_and_a_metered_one_loads_torchs_dict():
    from polyamp.compat.torch import GradScaler

    plain = GradScaler("cpu", init_scale=2.0**8)
    facade_run(plain, range(2))
    assert "steps" not in plain.state_dict()
    metered = GradScaler("cpu", meter=polyamp.PrecisionMeter(every=EVERY))
    metered.load_state_dict(plain.state_dict())  # torch's five keys: the steps start again at 0
    assert metered.metrics()["steps"] == 0 and metered.state_dict()["steps"] == 0


@pytest.mark.parametrize("bad", [-1, 2**63, "3", True, 2.5, None])
def test_a_bad_steps_is_refused_naming_it_and_the_facade_is_unchanged(bad):
    from polyamp.compat.torch import GradScaler

    scaler = GradScaler("cpu", init_scale=2.0**8, meter=polyamp.PrecisionMeter(every=EVERY))
    facade_run(scaler, range(2))
    before = scaler.state_dict()
    with pytest.raises(polyamp.StateDictError, match="steps") as info:
        scaler.load_state_dict({**before, "scale": 4.0, "steps": bad})
    assert "Fix:" in str(info.value)
    assert scaler.state_dict() == before
