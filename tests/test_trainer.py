"""MixedPrecisionTrainer on NumPy (ArrayModel protocol) and torch (nn.Module + autocast)."""

from __future__ import annotations

import math

import numpy as np
import pytest

import polyamp
from polyamp import LossScaleConfig, MixedPrecisionTrainer, Parameter, StepMetrics
from polyamp.optim import SGD, Adam

DTYPES = ["float16", "bfloat16", "float32"]


def _np_dtype(name):
    if name == "bfloat16":
        return pytest.importorskip("ml_dtypes").bfloat16
    return np.dtype(name)


class Linear:
    """``x @ w + b`` computed in the compute dtype from low-precision copies of float32 masters."""

    def __init__(self, n_in, n_out, seed=0):
        rng = np.random.default_rng(seed)
        self.w = Parameter((rng.standard_normal((n_in, n_out)) * 0.1).astype(np.float32))
        self.b = Parameter(np.zeros(n_out, np.float32))
        self.seen = {}

    def parameters(self):
        return [self.w, self.b]

    def forward(self, x, compute_dtype):
        dt = _np_dtype(compute_dtype)
        self.x, self.dt = x, dt
        self.seen["input"] = x.dtype
        w = self.w.data.astype(dt).astype(np.float32)  # low-precision copy, held exactly
        return (x.astype(np.float32) @ w + self.b.data.astype(dt).astype(np.float32)).astype(dt)

    def backward(self, grad_output):
        self.seen["grad_output"] = grad_output.dtype
        g = grad_output.astype(np.float32)
        with np.errstate(over="ignore", invalid="ignore"):  # overflow is the scaler's to catch
            self.w.grad[...] = (self.x.astype(np.float32).T @ g).astype(self.dt)  # rounded to dtype
            self.b.grad[...] = g.sum(axis=0).astype(self.dt)


def _data(n=256, seed=1):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, 4)).astype(np.float32)
    y = x @ rng.standard_normal((4, 2)).astype(np.float32) + 0.5
    return x, y.astype(np.float32)


def mse(divisor=None):
    def loss_fn(output, target):
        err = output.astype(np.float32) - target.astype(np.float32)
        n = err.size if divisor is None else divisor
        return np.sum(err * err) / n, 2 * err / n

    return loss_fn


@pytest.mark.parametrize("dtype", DTYPES)
def test_numpy_trainer_trains_in_each_dtype(dtype):
    model = Linear(4, 2)
    trainer = MixedPrecisionTrainer(model, Adam(model.parameters(), lr=0.05), dtype)
    x, y = _data()
    first = trainer.train_step(x, y, mse())
    for _ in range(150):
        last = trainer.train_step(x, y, mse())
    assert isinstance(last, StepMetrics) and isinstance(last.loss, float)
    assert last.loss < first.loss / 20, (first, last)
    assert not last.skipped and math.isfinite(last.grad_norm) and last.grad_norm > 0
    assert last.loss_scale == 2.0**16 and trainer.loss_scale == 2.0**16 and trainer.skipped_steps == 0
    assert model.seen == {"input": _np_dtype(dtype), "grad_output": _np_dtype(dtype)}
    assert all(p.data.dtype == np.float32 for p in model.parameters())  # masters stay float32
    assert all(np.shares_memory(p.grad, trainer.grads.flat) for p in model.parameters())
    assert trainer.compute_dtype == dtype and trainer.model is model and trainer.steps == 151


def test_overflow_skips_the_step_and_backs_off():
    model = Linear(4, 2)
    trainer = MixedPrecisionTrainer(model, SGD(model.parameters(), lr=0.1), "float16",
                                    LossScaleConfig(init_scale=2.0**40))
    x, y = _data()
    before = [p.data.copy() for p in model.parameters()]
    metrics = trainer.train_step(x, y, mse())
    assert metrics.skipped and metrics.loss_scale == 2.0**40 and not math.isfinite(metrics.grad_norm)
    assert all(np.array_equal(b, p.data) for b, p in zip(before, model.parameters()))
    assert trainer.loss_scale == 2.0**39 and trainer.skipped_steps == 1
    history = [trainer.train_step(x, y, mse()) for _ in range(40)]
    assert history[-1].skipped is False and trainer.skipped_steps >= 2
    assert trainer.skipped_steps == 1 + sum(m.skipped for m in history)


def test_float16_gradients_underflow_without_scaling():
    x, y = _data()
    loss_fn = mse(divisor=2**30)  # a mean over a large (global) batch: tiny per-sample gradients
    grads = {}
    for name, dtype, scaling in (("fp32", "float32", False), ("fp16", "float16", False),
                                 ("fp16+polyamp", "float16", True)):
        model = Linear(4, 2)
        trainer = MixedPrecisionTrainer(model, SGD(model.parameters(), lr=0.0), dtype, loss_scaling=scaling)
        trainer.train_step(x, y, loss_fn)
        grads[name] = trainer.grads.flat.copy()
    assert np.all(grads["fp16"] == 0) and np.all(grads["fp32"] != 0)
    np.testing.assert_allclose(grads["fp16+polyamp"], grads["fp32"], rtol=2e-2)


def test_clipping_reports_the_norm_before_clipping():
    model = Linear(4, 2)
    trainer = MixedPrecisionTrainer(model, SGD(model.parameters(), lr=0.0), "float16", max_grad_norm=0.01)
    metrics = trainer.train_step(*_data(), mse())
    assert metrics.grad_norm > 0.01
    assert float(np.linalg.norm(trainer.grads.flat)) == pytest.approx(0.01, rel=1e-3)


def test_no_loss_scaling_never_skips():
    model = Linear(4, 2)
    trainer = MixedPrecisionTrainer(model, SGD(model.parameters(), lr=0.01), "float16", loss_scaling=False)
    metrics = trainer.train_step(*_data(), mse())
    assert metrics.loss_scale == 1.0 and not metrics.skipped and trainer.loss_scale == 1.0


def test_bad_arguments_are_named():
    model = Linear(4, 2)
    opt = SGD(model.parameters(), lr=0.1)
    for bad in ("float64", "int8", np.int32):
        with pytest.raises(polyamp.ConfigError, match="compute_dtype"):
            MixedPrecisionTrainer(model, opt, bad)
    with pytest.raises(polyamp.ConfigError, match="max_norm"):
        MixedPrecisionTrainer(model, opt, "float16", max_grad_norm=-1.0)
    with pytest.raises(polyamp.ConfigError, match="does not hold model parameters at indices \\[1\\]"):
        MixedPrecisionTrainer(model, SGD([model.w], lr=0.1), "float16")
    with pytest.raises(TypeError, match="ArrayModel"):
        MixedPrecisionTrainer(object(), opt, "float16")
    half = Linear(4, 2)
    half.w.data = half.w.data.astype(np.float16)
    with pytest.raises(polyamp.ConfigError, match="must be float32"):
        MixedPrecisionTrainer(half, SGD(half.parameters(), lr=0.1), "float16")


# -- torch -------------------------------------------------------------------------------
@pytest.fixture
def torch():
    return pytest.importorskip("torch")


def _torch_model(torch):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))


@pytest.mark.parametrize("dtype", DTYPES)
def test_torch_trainer_trains_under_autocast(torch, dtype):
    model = _torch_model(torch)
    seen = []
    model[0].register_forward_hook(lambda mod, inp, out: seen.append(out.dtype))
    trainer = MixedPrecisionTrainer(model, torch.optim.Adam(model.parameters(), lr=0.02), dtype)
    x, y = (torch.from_numpy(a) for a in _data())
    first = trainer.train_step(x, y, torch.nn.functional.mse_loss)
    for _ in range(100):
        last = trainer.train_step(x, y, torch.nn.functional.mse_loss)
    assert last.loss < first.loss / 10 and not last.skipped and last.grad_norm > 0
    assert seen[0] == getattr(torch, dtype)  # the linear layer computed in the compute dtype
    assert all(p.dtype == torch.float32 for p in model.parameters())
    flat = trainer.grads.flat
    assert all(flat.data_ptr() <= p.grad.data_ptr() < flat.data_ptr() + 4 * flat.numel()
               for p in model.parameters())
    assert trainer.skipped_steps == 0 and trainer.loss_scale == 2.0**16


def test_torch_overflow_is_skipped(torch):
    model = _torch_model(torch)
    trainer = MixedPrecisionTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), "float16",
                                    LossScaleConfig(init_scale=2.0**60))
    before = [p.detach().clone() for p in model.parameters()]
    x, y = (torch.from_numpy(a) for a in _data())
    metrics = trainer.train_step(x, y, torch.nn.functional.mse_loss)
    assert metrics.skipped and trainer.skipped_steps == 1 and trainer.loss_scale == 2.0**59
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))


def test_torch_loss_must_be_a_scalar(torch):
    model = _torch_model(torch)
    trainer = MixedPrecisionTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), "bfloat16")
    x, y = (torch.from_numpy(a) for a in _data())
    with pytest.raises(ValueError, match="scalar"):
        trainer.train_step(x, y, lambda out, t: torch.nn.functional.mse_loss(out, t, reduction="none"))
