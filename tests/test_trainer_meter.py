"""MixedPrecisionTrainer(meter=) (issue 33, item 1): each sample step's report counts the unscaled float32
master gradients, named by the model's ``named_parameters()``, held to ``meter.count`` of the same
gradients; NumPy (the demo MLP) and torch (an nn.Module under autocast)."""

from __future__ import annotations

import functools

import numpy as np
import pytest

import polyamp
from polyamp.demo.data import spirals
from polyamp.demo.mlp import MLP, softmax_cross_entropy
from polyamp.optim import Adam

TARGETS = (("float16", 1.0), ("float16", "loss"), ("bfloat16", 1.0))
LOSS = functools.partial(softmax_cross_entropy, normalizer=2**24)  # the demo's: a share of a large batch


def demo_trainer(**kwargs):
    model = MLP([2, 16, 3], seed=2)
    return polyamp.MixedPrecisionTrainer(model, Adam(model.parameters(), lr=1e-2), "float16",
                                         polyamp.LossScaleConfig(init_scale=2.0**16, growth_interval=1),
                                         **kwargs)


def direct(meter, trainer, step: int, scale: float):
    """The report of ``meter.count`` on the trainer's (unscaled) master gradients, by name."""
    named = {name: np.array(p.grad) for name, p in trainer.model.named_parameters()}
    counts, extremes = meter.count(polyamp.get_backend("numpy"), list(named.values()), scale)
    return meter.report(step, scale, list(named), counts, extremes)


def test_sample_steps_report_the_master_gradients_named_by_the_model():
    meter = polyamp.PrecisionMeter(every=2, targets=TARGETS)
    trainer = demo_trainer(meter=meter)
    x, y = spirals(256, seed=0)
    assert trainer.last_precision is None
    for step in range(5):
        before = trainer.last_precision
        metrics = trainer.train_step(x, y, LOSS)
        report = trainer.last_precision
        if step % 2 == 0:
            assert report == direct(meter, trainer, step, metrics.loss_scale)
            assert report.scale == metrics.loss_scale == 2.0 ** (16 + step)  # growth_interval=1
            assert [t.name for t in report.tensors] == [
                "layers.0.weight", "layers.0.bias", "layers.1.weight", "layers.1.bias"]
            fractions = report.fractions()
            assert {k: trainer.scaler.metrics()[k] for k in fractions} == fractions
        else:
            assert report is before
    assert trainer.skipped_steps == 0


def test_without_loss_scaling_the_meter_counts_at_scale_one_and_sees_the_lost_gradients():
    meter = polyamp.PrecisionMeter(every=1, targets=TARGETS)
    x, y = spirals(256, seed=0)
    unscaled, scaled = demo_trainer(meter=meter, loss_scaling=False), demo_trainer(meter=meter)
    unscaled.train_step(x, y, LOSS)
    scaled.train_step(x, y, LOSS)
    lost, kept = unscaled.last_precision, scaled.last_precision
    assert lost == direct(meter, unscaled, 0, 1.0) and lost.scale == 1.0
    assert unscaled.loss_scale == 1.0
    zeros = [sum(t.zeros for t in r.tensors) for r in (lost, kept)]
    assert zeros[0] > 2 * zeros[1]  # float16's backward at scale 1 flushed most of what 2**16 keeps
    assert kept.totals["float16@loss"].underflow == 0 < kept.totals["float16@1"].underflow


def test_a_trainer_without_a_meter_has_no_report_and_a_bad_meter_is_refused():
    trainer = demo_trainer()
    trainer.train_step(*spirals(64, seed=0), LOSS)
    assert trainer.last_precision is None
    assert not any("fraction" in k for k in trainer.scaler.metrics())
    with pytest.raises(TypeError, match=r"meter must be a polyamp.PrecisionMeter or None, got meter=100"):
        demo_trainer(meter=100)


def test_a_torch_module_is_named_by_its_named_parameters():
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(2, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    meter = polyamp.PrecisionMeter(every=1, targets=TARGETS)
    trainer = polyamp.MixedPrecisionTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), "bfloat16",
                                            polyamp.LossScaleConfig(init_scale=2.0**8), meter=meter)
    x, y = spirals(64, seed=1)
    metrics = trainer.train_step(torch.from_numpy(x), torch.from_numpy(y), torch.nn.functional.cross_entropy)
    report = trainer.last_precision
    named = {name: p.grad.detach().numpy().copy() for name, p in model.named_parameters()}
    counts, extremes = meter.count(polyamp.get_backend("numpy"), list(named.values()), metrics.loss_scale)
    assert report == meter.report(0, metrics.loss_scale, list(named), counts, extremes)
    assert [t.name for t in report.tensors] == ["0.weight", "0.bias", "2.weight", "2.bias"]
