"""Overflow forensics in the paddle facade: diagnose=, explain(layer/optimizer/grads) named by
``param.name``, last_overflow on skipped steps only, the log line."""

from __future__ import annotations

import logging

import numpy as np
import pytest

paddle = pytest.importorskip("paddle")

from polyamp.compat.paddle import AmpScaler, GradScaler  # noqa: E402


def layer_and_optimizer():
    paddle.seed(0)
    layer = paddle.nn.Sequential(paddle.nn.Linear(4, 3), paddle.nn.Linear(3, 2))
    return layer, paddle.optimizer.SGD(learning_rate=0.1, parameters=layer.parameters())


def backward(layer, scaler, x):
    layer.clear_gradients()
    scaled = scaler.scale(layer(paddle.to_tensor(x)).sum())
    scaled.backward()
    return scaled


NAN_INPUT = np.array([[np.nan, 1, 1, 1]], np.float32)
FINE_INPUT = np.ones((1, 4), np.float32)


def test_skipped_step_reports_by_param_name_and_applied_clears(caplog):
    layer, opt = layer_and_optimizer()
    scaler = GradScaler(diagnose=True)
    backward(layer, scaler, NAN_INPUT)
    with caplog.at_level(logging.INFO, logger="polyamp"):
        scaler.step(opt)
        scaler.update()
    report = scaler.last_overflow
    # the nan input: every gradient of layer 1's weight (3 x 2), and row 0 of layer 0's (1 x 3)
    w0, w1 = layer[0].weight.name, layer[1].weight.name
    assert report.checked == 4 and [(t.name, t.nan) for t in report.tensors] == [(w1, 6), (w0, 3)]
    assert report.diagnosis.startswith(f"2 of 4 gradient tensors hold inf/nan at scale 65536 (most in {w1})")
    assert caplog.records[-1].getMessage().endswith(f"; inf/nan in {w1} (6 nan), {w0} (3 nan)")
    backward(layer, scaler, FINE_INPUT)
    scaler.step(opt)
    scaler.update()
    assert scaler.last_overflow is None


def test_minimize_reports_too_and_explain_is_read_only():
    layer, opt = layer_and_optimizer()
    scaler = AmpScaler(diagnose=True)
    backward(layer, scaler, FINE_INPUT)
    grad = layer[1].bias._grad_ivar()
    before = grad.numpy().copy()
    assert not scaler.explain(layer) and scaler.explain(opt).checked == 4
    np.testing.assert_array_equal(grad.numpy(), before)
    names = [p.name for p in layer.parameters()]
    grads = [p._grad_ivar() for p in layer.parameters()]
    assert scaler.explain(grads, names=names, loss=float("nan")).loss_finite is False
    scaler.minimize(opt, backward(layer, scaler, NAN_INPUT))
    assert scaler.last_overflow is not None and scaler.last_overflow.found


def test_diagnose_keyword_checked_and_disabled_scaler_reports_nothing():
    with pytest.raises(TypeError, match="diagnose=None"):
        GradScaler(diagnose=None)  # type: ignore[arg-type]
    layer, opt = layer_and_optimizer()
    disabled = GradScaler(enable=False, diagnose=True)
    backward(layer, disabled, NAN_INPUT)
    disabled.step(opt)
    assert disabled.last_overflow is None and disabled.explain(layer).scale == 1.0


def test_copies_keep_diagnose():
    import copy

    scaler = GradScaler(diagnose=True)
    assert copy.deepcopy(scaler)._diagnose is True
