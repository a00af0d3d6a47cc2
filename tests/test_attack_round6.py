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
