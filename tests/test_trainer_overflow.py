"""MixedPrecisionTrainer(diagnose=True): StepMetrics.overflow on skipped steps only, named after
the model's parameters, with the loss; the demo MLP and a torch model."""

from __future__ import annotations

import numpy as np
import pytest

from polyamp import LossScaleConfig, MixedPrecisionTrainer
from polyamp.demo import MLP, softmax_cross_entropy, spirals
from polyamp.optim import SGD


def demo_trainer(diagnose: bool = True) -> tuple[MixedPrecisionTrainer, MLP]:
    model = MLP([2, 16, 16, 3], seed=0)
    return MixedPrecisionTrainer(model, SGD(model.parameters(), lr=0.1), "float16",
                                 diagnose=diagnose), model


def test_demo_mlp_overflow_is_reported_by_layer_name():
    x, y = spirals(64, seed=0)
    trainer, model = demo_trainer()
    before = [p.data.copy() for p in model.parameters()]
    model.parameters()[2].data[0, :4] = 3e4  # layers.1.weight: float16 activations overflow
    with np.errstate(invalid="ignore", over="ignore"):  # inf * 0 in the float16 backward
        metrics = trainer.train_step(x, y, softmax_cross_entropy)
    report = metrics.overflow
    assert metrics.skipped and report is not None and report.found
    assert report.checked == 6 and report.scale == metrics.loss_scale == 65536.0
    assert {t.name for t in report.tensors} <= {n for n, _ in model.named_parameters()}
    assert report.loss_finite is True and np.isfinite(metrics.loss)  # the gradients overflowed
    model.parameters()[2].data[...] = before[2]
    metrics = trainer.train_step(x, y, softmax_cross_entropy)
    assert not metrics.skipped and metrics.overflow is None


def test_nan_loss_is_diagnosed_as_the_loss():
    x, y = spirals(32, seed=0)
    trainer, model = demo_trainer()
    x = x.copy()
    x[0, 0] = np.nan
    metrics = trainer.train_step(x, y, softmax_cross_entropy)
    assert metrics.skipped and metrics.overflow.loss_finite is False
    assert metrics.overflow.diagnosis.startswith("the loss itself is not finite")


def test_without_diagnose_no_report():
    x, y = spirals(32, seed=0)
    trainer, model = demo_trainer(diagnose=False)
    model.parameters()[0].data[...] = np.nan
    metrics = trainer.train_step(x, y, softmax_cross_entropy)
    assert metrics.skipped and metrics.overflow is None


def test_torch_model_names_from_named_parameters():
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    trainer = MixedPrecisionTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), "float16",
                                    LossScaleConfig(init_scale=2.0**16), diagnose=True)
    with torch.no_grad():
        model[1].weight.fill_(1e4)  # d loss / d layer-0 output overflows float16 under the scale
    metrics = trainer.train_step(torch.ones(4, 4), torch.zeros(4, 2), torch.nn.functional.mse_loss)
    assert metrics.skipped
    names = {t.name for t in metrics.overflow.tensors}
    assert names and names <= {"0.weight", "0.bias", "1.weight", "1.bias"}


def test_diagnose_must_be_a_bool():
    model = MLP([2, 3], seed=0)
    with pytest.raises(TypeError, match="diagnose=0"):
        MixedPrecisionTrainer(model, SGD(model.parameters(), lr=0.1), diagnose=0)  # type: ignore[arg-type]
