"""scaler.metrics() on the engine and both facades: plain numbers, the window, one host read."""

from __future__ import annotations

import math
import pickle

import numpy as np
import pytest

import polyamp
from polyamp.metrics import WINDOW_KEY, SkipWindow


def _engine_steps(scaler, overflow_at, n):
    for i in range(n):
        grads = {"w": np.array([1.0, math.inf if i in overflow_at else 2.0], dtype=np.float32)}
        scaler.step(grads, lambda: None)
        scaler.update()


def test_engine_metrics_are_plain_numbers_that_follow_the_steps():
    scaler = polyamp.LossScaler(polyamp.LossScaleConfig(init_scale=8.0, growth_interval=100), diagnose=True)
    _engine_steps(scaler, {1, 4}, 5)  # the last step skipped: its report is kept
    m = scaler.metrics()
    assert m == {"scale": 2.0, "steps": 5, "skipped_steps": 2, WINDOW_KEY: 2}
    assert all(type(v) in (int, float) for v in m.values())
    assert scaler.metrics(diagnose=True)["last_overflow/w"] == 1
    with pytest.raises(TypeError, match="diagnose=1"):
        scaler.metrics(diagnose=1)


def test_window_forgets_skips_older_than_its_size():
    window = SkipWindow(size=3)
    for skipped in (True, False, True, False, False):
        window.record(skipped)
    assert window.skips == 1  # decisions 3..5 hold the skip at 3
    window = SkipWindow(size=3)
    for skipped in (True, False, True, False):
        window.record(skipped)
    assert window.skips == 1  # decisions 2..4 hold the skip at 3 only


def test_engine_metrics_survive_a_pickle_and_the_checkpoint_keeps_the_counters():
    scaler = polyamp.LossScaler()
    _engine_steps(scaler, {0}, 2)
    copy = pickle.loads(pickle.dumps(scaler))
    assert copy.metrics() == scaler.metrics()
    loaded = polyamp.LossScaler()
    loaded.load_state_dict(scaler.state_dict())
    assert loaded.metrics()["steps"] == 2 and loaded.metrics()["skipped_steps"] == 1


def test_paddle_facade_metrics():
    from polyamp.compat.paddle import GradScaler

    scaler = GradScaler(init_loss_scaling=16.0, decr_every_n_nan_or_inf=1)
    params = [polyamp.Parameter(np.ones(2, dtype=np.float32))]
    optimizer = polyamp.optim.SGD(params, lr=0.1)
    for i in range(3):
        params[0].grad = np.array([1.0, math.inf if i == 1 else 1.0], dtype=np.float32) * 16
        scaler.minimize(optimizer)
    assert scaler.metrics() == {"scale": 8.0, "steps": 3,
                                "skipped_steps": 1, WINDOW_KEY: 1}


torch = pytest.importorskip("torch")


def _torch_loop(scaler, optimizer, w, overflow_at, n):
    for i in range(n):
        optimizer.zero_grad()
        loss = (w * w).sum() * (math.inf if i in overflow_at else 1.0)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()


@pytest.mark.parametrize("fused", [False, True])
def test_torch_facade_metrics_read_the_scale_once_and_nothing_between_calls(counting_host_reads, fused):
    from polyamp.compat.torch import GradScaler

    def run(make_scaler):
        w = torch.nn.Parameter(torch.ones(3))
        optimizer = torch.optim.Adam([w], lr=0.1, fused=True) if fused else torch.optim.SGD([w], lr=0.1)
        scaler = make_scaler("cpu", init_scale=4.0)
        _torch_loop(scaler, optimizer, w, {0}, 1)  # a skip; the state exists on the device
        with counting_host_reads() as between:
            _torch_loop(scaler, optimizer, w, set(), 3)  # applied steps (a skip reads the scale to log it)
        return scaler, between

    scaler, between = run(GradScaler)
    _, torch_between = run(torch.amp.GradScaler)
    assert between == torch_between  # as torch's: fused, none; else the skip decision of each step
    assert between["_local_scalar_dense"] == (0 if fused else 3)
    with counting_host_reads() as reads:
        m = scaler.metrics()
    assert sum(reads.values()) == 1
    assert m == {"scale": 2.0, "steps": 4, "skipped_steps": 1, WINDOW_KEY: 1}
    assert scaler.skipped_steps == 1  # the pending flags were counted once, not twice
    copy = pickle.loads(pickle.dumps(scaler))
    assert copy.metrics() == m


def test_torch_facade_diagnose_names_the_top_tensors_and_disabled_has_none():
    from polyamp.compat.torch import GradScaler

    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = GradScaler("cpu", diagnose=True)
    scaler.name_parameters(model)
    scaler.scale(model(torch.tensor([[math.inf, 1.0]])).sum()).backward()
    scaler.step(optimizer)
    scaler.update()
    m = scaler.metrics(diagnose=True)
    assert m["last_overflow/tensors"] == 1 and "last_overflow/bias" not in m
    assert m["last_overflow/weight"] >= 1 and m["skipped_steps"] == 1
    assert GradScaler("cpu", enabled=False).metrics() == {}


def test_engine_metrics_one_read_on_torch(counting_host_reads):
    scaler = polyamp.LossScaler()
    grads = [torch.ones(2)]
    scaler.step(grads, lambda: None)
    scaler.update()
    with counting_host_reads() as reads:
        assert scaler.metrics()["steps"] == 1
    assert sum(reads.values()) == 1
