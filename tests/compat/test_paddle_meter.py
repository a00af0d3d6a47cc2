"""The paddle facade's ``meter=`` (issue 33, item 1): real paddle (CPU) layers and optimizers, reports
named by ``param.name``, held to ``PrecisionMeter.count`` of the same unscaled gradients on NumPy."""

from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest
from polyamp.compat.paddle import AmpScaler, GradScaler

import polyamp

paddle = pytest.importorskip("paddle")

TARGETS = (("float16", "loss"), ("bfloat16", 1.0), ("float8_e4m3fn", "amax"))


def layer_and_optimizer(seed: int = 0):
    """A paddle Linear (weights small enough that float16 loses some of their gradients) and SGD."""
    paddle.seed(seed)
    layer = paddle.nn.Linear(8, 4)
    return layer, paddle.optimizer.SGD(learning_rate=0.1, parameters=layer.parameters())


def backward(scaler, layer, step: int, bad: bool = False):
    """A scaled backward of a loss small enough that some gradients fall below float16's range."""
    rng = np.random.default_rng(step)
    x = paddle.to_tensor((rng.standard_normal((16, 8)) * 1e-4).astype(np.float32))
    loss = (layer(x) ** 2).mean() * 1e-3
    if bad:
        loss = loss * float("inf")
    scaled = scaler.scale(loss)
    scaled.backward()
    return scaled


def direct(meter, layer, step: int, scale: float):
    """The report of ``meter.count`` on NumPy copies of the layer's (unscaled) gradients."""
    named = {p.name: np.asarray(p.grad.numpy()) for p in layer.parameters()}
    counts, extremes = meter.count(polyamp.get_backend("numpy"), list(named.values()), scale)
    return meter.report(step, scale, list(named), counts, extremes)


@pytest.mark.parametrize("verb", ["step", "minimize"])
def test_sample_steps_report_what_numpy_counts_named_by_param_name(verb):
    meter = polyamp.PrecisionMeter(every=2, targets=TARGETS)
    scaler = GradScaler(init_loss_scaling=2.0**10, incr_every_n_steps=1, meter=meter)
    layer, opt = layer_and_optimizer()
    assert scaler.last_precision is None
    for step in range(5):
        scale = scaler.engine.get_scale()
        scaled = backward(scaler, layer, step)
        before = scaler.last_precision
        if verb == "step":
            scaler.unscale_(opt)  # the gradients as they are counted: unscaled
            expected = direct(meter, layer, step, scale)
            scaler.step(opt)
            scaler.update()
        else:
            scaler.unscale_(opt)
            expected = direct(meter, layer, step, scale)
            scaler.minimize(opt, scaled)  # paddle's: minimize(optimizer, scaled_loss)
        report = scaler.last_precision
        if step % 2 == 0:
            assert report == expected
            assert [t.name for t in report.tensors] == [p.name for p in layer.parameters()]
            assert report.step == step and report.scale == scale
            assert report.tensors[0].numel == 32
        else:  # a non-sample step keeps the last report
            assert report is before
        opt.clear_grad()
    assert scaler.engine.get_scale() == 2.0**15  # the scale grew every step: the meter changes nothing


def test_minimize_alone_counts_the_gradients_it_unscales():
    meter = polyamp.PrecisionMeter(every=1)
    scaler = AmpScaler(init_loss_scaling=2.0**12, meter=meter)
    layer, opt = layer_and_optimizer(1)
    loss = backward(scaler, layer, 0)
    scaled = {p.name: np.asarray(p.grad.numpy()) / np.float32(2.0**12) for p in layer.parameters()}
    scaler.minimize(opt, loss)
    counts, extremes = meter.count(polyamp.get_backend("numpy"), list(scaled.values()), 2.0**12)
    assert scaler.last_precision == meter.report(0, 2.0**12, list(scaled), counts, extremes)
    assert scaler.last_precision.totals["float16@loss"].underflow > 0  # the test sees an underflow


def test_metrics_gain_the_fractions_after_a_sample_step():
    meter = polyamp.PrecisionMeter(every=3)
    scaler = GradScaler(init_loss_scaling=1.0, meter=meter)
    layer, opt = layer_and_optimizer(2)
    assert not any("fraction" in key for key in scaler.metrics())
    backward(scaler, layer, 0)
    scaler.step(opt)
    scaler.update()
    metrics = scaler.metrics()
    fractions = scaler.last_precision.fractions()
    assert {k: metrics[k] for k in fractions} == fractions
    assert metrics["underflow_fraction/float16@loss"] > 0.0  # at scale 1 float16 loses some of them
    assert "overflow_fraction/bfloat16@1" in metrics


def test_a_skipped_sample_step_counts_the_gradients_not_what_paddles_kernel_left():
    """paddle's unscale kernel writes grad * 0 on an overflow; a sample step counts the values."""
    meter = polyamp.PrecisionMeter(every=1)
    scaler = GradScaler(init_loss_scaling=2.0**4, meter=meter)
    layer, opt = layer_and_optimizer(3)
    x = paddle.to_tensor(np.array([[1.0] * 8, [1e38] + [0.0] * 7], np.float32))  # one row of w: inf
    scaler.scale(layer(x).sum()).backward()
    held = {p.name: np.asarray(p.grad.numpy()) / np.float32(2.0**4) for p in layer.parameters()}
    scaler.step(opt)
    scaler.update()
    assert scaler.last_step_skipped
    counts, extremes = meter.count(polyamp.get_backend("numpy"), list(held.values()), 2.0**4)
    report = scaler.last_precision
    assert report == meter.report(0, 2.0**4, list(held), counts, extremes)
    assert [(t.nonfinite, t.zeros, t.amax) for t in report.tensors] == [(4, 0, 1.0), (0, 0, 2.0)]
    for copied in (copy.deepcopy(scaler), pickle.loads(pickle.dumps(scaler))):
        assert copied.last_precision == report
        assert copied._iteration.metering.meter == meter


def test_a_bad_meter_is_refused_naming_it_and_a_disabled_scaler_counts_nothing():
    with pytest.raises(TypeError, match=r"meter must be a polyamp.PrecisionMeter or None, got meter=5"):
        GradScaler(meter=5)
    with pytest.raises(TypeError, match="meter="):
        GradScaler(enable=False, meter="every step")
    scaler = GradScaler(enable=False, meter=polyamp.PrecisionMeter(every=1))
    layer, opt = layer_and_optimizer()
    backward(scaler, layer, 0)
    scaler.step(opt)
    scaler.update()
    assert scaler.last_precision is None
