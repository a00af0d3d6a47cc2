"""Regression tests for the adversarial review of issue 33's precision meter (round 6), in one process.

Each test failed on the code it was written against; each passes since its fix.
"""

from __future__ import annotations

import numpy as np
import pytest

import polyamp
from polyamp.precision import FloatFormat, PrecisionMeter


# -- 1: a check-only unscale on a sample step reported "0 gradients, nothing to measure" ------------
def test_a_check_only_sample_step_makes_no_report_claiming_nothing_to_measure():
    scaler = polyamp.LossScaler(init_scale=1024.0, meter=PrecisionMeter(every=1))
    grads = [np.full(5, 1024.0, np.float32)]
    scaler.unscale_(grads, check_only=True)  # still scaled: nothing exact to count
    scaler.update()
    assert scaler.last_precision is None
    scaler.step(grads, lambda: None)  # the next sample step still counts what it unscales
    scaler.update()
    report = scaler.last_precision
    assert [(t.name, t.numel, t.amax) for t in report.tensors] == [("grads[0]", 5, 1.0)]


def test_the_torch_facade_with_a_fused_optimizer_makes_no_empty_report():
    torch = pytest.importorskip("torch")
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.Adam(model.parameters(), fused=True)  # unscales itself: check only
    scaler = polyamp.GradScaler("cpu", init_scale=2.0**10, meter=PrecisionMeter(every=1))
    scaler.scale(model(torch.randn(5, 4)).sum()).backward()
    before = model.weight.detach().clone()
    scaler.step(optimizer)
    scaler.update()
    assert scaler.last_precision is None
    assert not torch.equal(model.weight.detach(), before)  # the step itself is unchanged


# -- 2: a FloatFormat of 11 exponent bits and the "fn" encoding raised OverflowError ---------------
@pytest.mark.parametrize("fmt", [FloatFormat("e11m52fn", 11, 52, "fn"), FloatFormat("e11m1fn", 11, 1, "fn")])
def test_a_format_beyond_float64_is_a_config_error_naming_it(fmt):
    with pytest.raises(polyamp.ConfigError, match=rf"targets\[0\]'s FloatFormat.*{fmt.name}.*Fix:"):
        PrecisionMeter(targets=((fmt, 1.0),))


# -- 3: a read-only NumPy gradient was refused as "gradient is read-only": no name, no fix ---------
@pytest.mark.parametrize("meter", [None, PrecisionMeter(every=1)])
@pytest.mark.parametrize("guard", [None, polyamp.StepGuard(max_grad_norm=1e9)])
def test_a_read_only_gradient_is_refused_naming_it_and_the_fix_and_nothing_changes(meter, guard):
    scaler = polyamp.LossScaler(init_scale=8.0, meter=meter, guard=guard)
    writable, locked = np.full(4, 8.0, np.float32), np.full(4, 8.0, np.float32)
    locked.flags.writeable = False
    with pytest.raises(ValueError, match=r"grads\[1\] is a read-only array .*flags\.writeable is False.*"
                                         r"Fix: .*np\.array\(g\)"):
        scaler.step([writable, locked], lambda: None)
    assert (writable == 8.0).all() and not scaler.has_pending_check and scaler.steps == 0
    scaler.step([writable, locked.copy()], lambda: None)  # the next step runs as if nothing happened
    scaler.update()
    assert (writable == 1.0).all() and scaler.steps == 1
    assert meter is None or scaler.last_precision.amax == 1.0


# -- 4: a NumPy scalar scale skipped the scale check (NumPy scalars have .shape): nan, -2, 0 counted
@pytest.mark.parametrize("scale", [np.float64(np.nan), np.float32(-2.0), np.array(0.0), np.float64(np.inf),
                                   np.bool_(True), np.array([1.0, 2.0])])
def test_count_and_measure_refuse_a_bad_numpy_scale_naming_scale(scale):
    from polyamp import functional

    meter = PrecisionMeter(every=1)
    grads = [np.full(3, 1e-6, np.float32)]
    with pytest.raises(polyamp.ConfigError, match=r"scale must be .*Fix:"):
        meter.count(polyamp.get_backend("numpy"), grads, scale)
    with pytest.raises(polyamp.ConfigError, match=r"scale must be .*Fix:"):
        functional.measure(grads, scale, meter.targets)


def test_count_takes_numpy_scalar_scales_as_numbers():
    meter = PrecisionMeter(every=1)
    grads = [np.full(3, 1e-6, np.float32)]
    numpy = polyamp.get_backend("numpy")
    want = meter.count(numpy, grads, 1024.0)
    for scale in (np.float32(1024.0), np.int64(1024), np.array(1024.0), np.array([1024.0])):
        got = meter.count(numpy, grads, scale)
        assert np.array_equal(got.counts, want.counts) and np.array_equal(got.extremes, want.extremes)
