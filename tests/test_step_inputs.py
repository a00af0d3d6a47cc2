"""MixedPrecisionTrainer.train_step's inputs and loss_fn results (polyamp/_step_inputs.py), issue 15:
each mistake is named before the scaler sees anything, and the masters and counters stay as they were.
"""

from __future__ import annotations

import numpy as np
import pytest

from polyamp import MixedPrecisionTrainer, Parameter
from polyamp.optim import SGD


class Linear:
    """``x @ w`` on NumPy: the smallest ArrayModel (float32 masters, compute-dtype forward)."""

    def __init__(self):
        self.w = Parameter(np.full((4, 2), 0.5, np.float32))

    def parameters(self):
        return [self.w]

    def forward(self, x, compute_dtype):
        self.x = x.astype(np.float32)
        return (self.x @ self.w.data).astype(compute_dtype)

    def backward(self, grad_output):
        self.w.grad[...] = self.x.T @ grad_output.astype(np.float32)


def mse(output, target):
    err = output.astype(np.float32) - target
    return np.mean(err * err), 2 * err / err.size


X, Y = np.ones((8, 4), np.float32), np.zeros((8, 2), np.float32)


def _trainer():
    model = Linear()
    return model, MixedPrecisionTrainer(model, SGD(model.parameters(), lr=0.1), "float16")


def _unchanged(model, trainer):
    assert model.w.data.tolist() == np.full((4, 2), 0.5).tolist()
    assert trainer.steps == 0 and trainer.skipped_steps == 0 and not trainer.scaler.has_pending_check
    assert trainer.loss_scale == 2.0**16


@pytest.mark.parametrize("bad", [None, [[1.0] * 4] * 8, "x"])
def test_input_that_is_not_an_array_is_named(bad):
    model, trainer = _trainer()
    with pytest.raises(TypeError, match=r"train_step\(\) needs input to be an array of the batch, got "):
        trainer.train_step(bad, Y, mse)
    _unchanged(model, trainer)


def test_target_may_be_none_but_not_a_list():
    model, trainer = _trainer()
    with pytest.raises(TypeError, match=r"needs target to be an array \(or None\), got target=\[0\.0\]"):
        trainer.train_step(X, [0.0], mse)
    _unchanged(model, trainer)
    seen = []

    def self_supervised(output, target):
        seen.append(target)
        return mse(output, np.zeros(output.shape, np.float32))

    assert not trainer.train_step(X, None, self_supervised).skipped and seen == [None]


@pytest.mark.parametrize(
    "loss_fn, error, message",
    [
        (lambda o, t: mse(o, t)[0], TypeError, r"must return \(loss, d loss / d output\).*numpy\.float32"),
        (lambda o, t: (mse(o, t)[0], None), TypeError, r"second value must be the gradient.*got None"),
        (lambda o, t: (mse(o, t)[0], np.ones(3, np.float32)), ValueError,
         r"gradient has shape \(3,\), but the model's output has shape \(8, 2\)"),
        (lambda o, t: (np.ones(2, np.float32), mse(o, t)[1]), ValueError,
         r"scalar \(0-d\) loss, got shape \(2,\)"),
    ],
    ids=["one-value", "none-gradient", "wrong-shape", "loss-not-scalar"],
)
def test_loss_fn_results_are_checked_before_the_backward(loss_fn, error, message):
    model, trainer = _trainer()
    with pytest.raises(error, match=message):
        trainer.train_step(X, Y, loss_fn)
    _unchanged(model, trainer)
    assert not trainer.train_step(X, Y, mse).skipped  # the trainer goes on


# -- torch ----------------------------------------------------------------------------------
def test_torch_model_names_non_tensors_and_a_tuple_loss():
    torch = pytest.importorskip("torch")
    model = torch.nn.Linear(4, 2)
    before = model.weight.detach().clone()
    trainer = MixedPrecisionTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), "bfloat16")
    x, y = torch.ones(8, 4), torch.zeros(8, 2)
    loss = torch.nn.functional.mse_loss
    with pytest.raises(TypeError, match=r"needs input to be an array of the batch, got input=None"):
        trainer.train_step(None, y, loss)
    with pytest.raises(TypeError, match=r"needs input to be a torch\.Tensor for a torch model, got numpy"):
        trainer.train_step(X, y, loss)
    with pytest.raises(TypeError, match=r"must return the loss tensor for a torch model, got \(tensor"):
        trainer.train_step(x, y, lambda o, t: (loss(o, t), None))
    assert torch.equal(model.weight, before) and trainer.steps == 0 and not trainer.scaler.has_pending_check
    assert not trainer.train_step(x, y, loss).skipped and not torch.equal(model.weight, before)
