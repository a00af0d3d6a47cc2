"""The scale floor end to end: long overflow runs leave the scale at 2**-126, weights stay finite.

torch.amp.GradScaler's scale decays to 0 after ~150 overflows from 2**16 and its next finite
steps write NaN into the weights (0 * inf in the unscale, which checks its input); polyamp stops
at the floor, keeps training, and logs one warning per scaler that names the usual causes.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest

import polyamp
from polyamp import LossScaleConfig, LossScaler
from polyamp.config import SCALE_FLOOR
from polyamp.optim import SGD

N_OVERFLOWS = 250  # from 2**16, 2**-126 is 142 backoffs away; torch reaches 0 after 166


def floor_warnings(caplog):
    return [r for r in caplog.records if r.name == "polyamp" and r.levelno == logging.WARNING
            and "floor" in r.getMessage()]


# -- LossScaler on NumPy ------------------------------------------------------------------
def engine_step(scaler, grads, step_fn):
    """step(), then update() if step left the check pending (works either way step is written)."""
    res = scaler.step(grads, step_fn)
    if scaler.has_pending_check:
        scaler.update()
    return res


def test_engine_stops_at_the_floor_and_finite_steps_keep_weights_finite():
    scaler = LossScaler(backend="numpy")
    w = np.ones(3, np.float32)
    for _ in range(N_OVERFLOWS):
        scaler.unscale_([np.full(3, np.inf, np.float32)])
        scaler.update()
    assert scaler.get_scale() == SCALE_FLOOR  # not subnormal, not 0
    want = w.copy()
    for _ in range(3):
        grad = scaler.scale(np.full(3, 0.5, np.float32))  # d(scale * 0.5 * sum(w)) / dw

        def sgd(grad=grad):
            w[...] -= np.float32(0.1) * grad

        res = engine_step(scaler, [grad], sgd)
        want -= np.float32(0.1) * np.float32(0.5)  # 0.5 * 2**-126 * 2**126 is exact
        assert not res.skipped
    assert np.isfinite(w).all()
    np.testing.assert_array_equal(w, want)


@pytest.mark.parametrize("product_dtype", ["float64", "float32"])
def test_engine_warns_once_when_skipped_steps_reach_the_floor(caplog, product_dtype):
    scaler = LossScaler(LossScaleConfig(product_dtype=product_dtype), backend="numpy")
    caplog.set_level(logging.WARNING, logger="polyamp")
    for i in range(N_OVERFLOWS):
        engine_step(scaler, [np.full(3, np.inf, np.float32)], lambda: None)
        if i == 100:  # 2**-85: not yet at the floor
            assert floor_warnings(caplog) == []
    (record,) = floor_warnings(caplog)
    message = record.getMessage()
    assert "2**-126" in message and "NaN" in message and "not zeroed" in message
    assert "learning rate" in message
    other = LossScaler(backend="numpy")  # once per scaler: another one warns for itself
    for _ in range(N_OVERFLOWS):
        engine_step(other, [np.full(3, np.inf, np.float32)], lambda: None)
    assert len(floor_warnings(caplog)) == 2


def test_no_floor_warning_when_min_scale_stops_the_scale(caplog):
    scaler = LossScaler(LossScaleConfig(min_scale=1.0), backend="numpy")
    caplog.set_level(logging.WARNING, logger="polyamp")
    for _ in range(40):
        engine_step(scaler, [np.full(3, np.inf, np.float32)], lambda: None)
    assert scaler.get_scale() == 1.0 and floor_warnings(caplog) == []


# -- the torch facade against real torch ----------------------------------------------------
def _torch_run(scaler_cls, n_overflows, finite_steps):
    import torch

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = scaler_cls("cpu")
    x = torch.linspace(-1, 1, 12).reshape(3, 4)
    scales = []
    for i in range(n_overflows + finite_steps):
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        if i < n_overflows:
            loss = loss * float("inf")
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return scales, [p.detach().clone() for p in model.parameters()]


@pytest.mark.filterwarnings("ignore::UserWarning")  # torch: GradScaler on CPU
def test_torch_facade_stops_at_the_floor_where_torch_writes_nan(caplog):
    torch = pytest.importorskip("torch")
    from polyamp.compat.torch import GradScaler

    caplog.set_level(logging.WARNING, logger="polyamp")
    torch_scales, torch_params = _torch_run(torch.amp.GradScaler, N_OVERFLOWS, 3)
    ours_scales, ours_params = _torch_run(GradScaler, N_OVERFLOWS, 3)
    assert torch_scales[-1] == 0.0 and any(p.isnan().any() for p in torch_params)  # torch's bug
    # docs/rule.md's figures: torch is subnormal after 143 overflows and 0 after 166.
    assert torch_scales[141] == SCALE_FLOOR and torch_scales[142] == 2.0**-127
    assert torch_scales[164] == 2.0**-149 and torch_scales[165] == 0.0
    assert ours_scales[141] == ours_scales[N_OVERFLOWS - 1] == SCALE_FLOOR == min(ours_scales)
    assert all(p.isfinite().all() for p in ours_params)
    assert not all(torch.equal(p, q) for p, q in zip(ours_params, _torch_run(
        GradScaler, N_OVERFLOWS, 0)[1], strict=True))  # the finite steps were applied
    # Bitwise torch's trajectory wherever torch's scale stays at or above the floor.
    same = [t for t in torch_scales if t >= SCALE_FLOOR]
    assert len(same) >= 140 and ours_scales[: len(same)] == same
    assert len(floor_warnings(caplog)) == 2  # once per polyamp scaler (two runs), none by torch


# -- the paddle facade --------------------------------------------------------------------
def test_paddle_facade_over_numpy_stops_at_the_floor_and_warns_once(caplog):
    from polyamp.compat.paddle import GradScaler

    caplog.set_level(logging.WARNING, logger="polyamp")
    param = polyamp.Parameter(np.ones(3, np.float32))
    opt, scaler = SGD([param], lr=0.5), GradScaler()
    for i in range(N_OVERFLOWS + 2):
        scale = scaler.scale(np.float32(1.0))
        param.grad = np.full(3, np.inf if i < N_OVERFLOWS else 1.0, np.float32) * scale
        scaler.minimize(opt)
    assert scaler.state_dict()["scale"][0] == np.float32(SCALE_FLOOR)
    assert not scaler.last_step_skipped
    np.testing.assert_array_equal(param.data, np.zeros(3, np.float32))  # 1 - 2 * 0.5 * 1.0
    assert len(floor_warnings(caplog)) == 1


def test_paddle_facade_on_paddle_tensors_stops_at_the_floor(caplog):
    paddle = pytest.importorskip("paddle")
    from polyamp.compat.paddle import GradScaler

    caplog.set_level(logging.WARNING, logger="polyamp")
    param = paddle.create_parameter(
        [3], "float32", default_initializer=paddle.nn.initializer.Constant(1.0)
    )
    opt, scaler = paddle.optimizer.SGD(0.5, parameters=[param]), GradScaler()
    for i in range(N_OVERFLOWS + 1):
        factor = paddle.to_tensor([np.inf if i < N_OVERFLOWS else 1.0] * 3)
        scaled = scaler.scale((param * factor).sum())
        scaled.backward()
        scaler.step(opt)
        scaler.update()
        opt.clear_grad()
    assert scaler.state_dict()["scale"][0] == np.float32(SCALE_FLOOR)
    assert not scaler.last_step_skipped
    np.testing.assert_array_equal(param.numpy(), np.full(3, 0.5, np.float32))  # 1 - 0.5 * 1.0
    assert len(floor_warnings(caplog)) == 1
