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


# -- bad steps never reach the weights ---------------------------------------------------------
class HugeGradient:
    """``x @ w``; backward writes d(scaled loss)/d(output) summed, times a fixed pattern with a
    huge but finite element: the float32 sum of its squares overflows, the values do not."""

    def __init__(self, pattern):
        self.w = Parameter(np.zeros(len(pattern), np.float32))
        self.pattern = np.asarray(pattern, np.float32)

    def parameters(self):
        return [self.w]

    def forward(self, x, compute_dtype):
        return x @ self.w.data

    def backward(self, grad_output):
        self.w.grad[...] = np.float32(np.sum(grad_output, dtype=np.float32)) * self.pattern


def _unit_loss(output, target):
    """A loss whose gradient sums to 1, so backward's seed sums to the loss scale."""
    return np.float32(0.0), np.full(output.shape, 1.0 / output.size, np.float32)


PATTERN = [3e19, -1.0, 2.0]


@pytest.mark.parametrize("max_grad_norm", [None, 1.0])
def test_huge_finite_gradients_are_clipped_and_applied(max_grad_norm):
    model = HugeGradient(PATTERN)
    trainer = MixedPrecisionTrainer(model, SGD(model.parameters(), lr=0.5), "float32",
                                    max_grad_norm=max_grad_norm)
    metrics = trainer.train_step(np.ones((4, 3), np.float32), np.zeros(4, np.float32), _unit_loss)
    norm = math.hypot(*np.asarray(PATTERN, np.float32).tolist())
    assert metrics.grad_norm == pytest.approx(norm, rel=1e-12) and not metrics.skipped
    if max_grad_norm is not None:  # the step moved the weights by lr * (gradient clipped to norm 1)
        np.testing.assert_allclose(model.w.data, -0.5 * np.asarray(PATTERN) / norm, rtol=1e-6)
        assert trainer.skipped_steps == 0


def test_torch_huge_finite_gradients_are_clipped(torch):
    model = _torch_model(torch)
    trainer = MixedPrecisionTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), "float32",
                                    max_grad_norm=1.0)
    before = [p.detach().clone() for p in model.parameters()]
    x, y = (torch.from_numpy(a) for a in _data())
    metrics = trainer.train_step(x, y, lambda out, t: out.sum() * 3e19)  # d loss / d out = 3e19
    assert math.isfinite(metrics.grad_norm) and metrics.grad_norm > 1e20 and not metrics.skipped
    moved = math.sqrt(sum(float(((p.detach() - b) ** 2).sum()) for b, p in zip(before, model.parameters())))
    assert moved == pytest.approx(0.1, rel=1e-4)  # lr * the clipped norm, 1


def test_without_loss_scaling_an_overflowed_step_is_skipped_and_counted():
    model = Linear(4, 2)
    trainer = MixedPrecisionTrainer(model, SGD(model.parameters(), lr=0.1), "float16", loss_scaling=False)
    x, y = _data()
    before = [p.data.copy() for p in model.parameters()]
    metrics = trainer.train_step(x * 1e3, y * 1e3, mse())  # float16 gradients overflow to inf
    assert metrics.skipped and not math.isfinite(metrics.grad_norm) and trainer.skipped_steps == 1
    assert all(np.array_equal(b, p.data) for b, p in zip(before, model.parameters()))
    assert not trainer.train_step(x, y, mse()).skipped and trainer.skipped_steps == 1


def test_a_non_finite_norm_joins_the_scalers_check():
    """With loss scaling the norm's flag goes to the scaler (no host read); the scaler then skips."""
    model = Linear(4, 2)
    trainer = MixedPrecisionTrainer(model, SGD(model.parameters(), lr=0.1), "float32")
    scaler = trainer.scaler
    grads = [np.ones(3, np.float32)]
    scaler.unscale_(grads)  # finite gradients: the scaler alone would apply the step
    assert trainer._check_norm(np.float64(np.nan)) is True
    ran = []
    assert scaler.step(grads, lambda: ran.append(1)).skipped and ran == [] and scaler.skipped_steps == 1


def test_trainer_halves_do_not_import_each_other():
    """trainer -> _trainer_torch and both -> _masters; no import back, not even in a function."""
    import ast
    from pathlib import Path

    root = Path(polyamp.__file__).parent

    def imports(name):
        """The polyamp modules ``name`` imports anywhere (``__init__``: the package itself)."""
        found = set()
        for node in ast.walk(ast.parse((root / f"{name}.py").read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                targets = [node.module] if node.module else [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "polyamp":
                targets = [node.module.partition(".")[2] or "__init__"]
            else:
                continue
            known = {t for t in targets if (root / f"{t}.py").exists() or (root / t).is_dir()}
            found |= known | ({"__init__"} if known != set(targets) else set())
        return found

    assert "trainer" not in imports("_trainer_torch") and "_masters" in imports("_trainer_torch")
    assert "__init__" not in imports("trainer") and "_masters" in imports("trainer")


# -- reducer=: data parallel (real process groups: tests/distributed/test_trainer_data_parallel.py) --
@pytest.mark.parametrize("loss_scaling", [True, False])
def test_reducer_averages_the_gradient_buffer_in_one_collective_per_step(loss_scaling, twins):
    x, y = _data()
    runs = {}
    for size in (None, 4):
        model = Linear(4, 2)
        red = None if size is None else twins(size)
        trainer = MixedPrecisionTrainer(model, SGD(model.parameters(), lr=0.1), "float16",
                                        LossScaleConfig(init_scale=2.0**10), loss_scaling=loss_scaling,
                                        max_grad_norm=1.0, reducer=red)
        assert trainer.reducer is red
        losses = [trainer.train_step(x, y, mse()).loss for _ in range(4)]
        runs[size] = (losses, model.w.data.copy(), model.b.data.copy(), red)
    (losses, w, b, _), (losses4, w4, b4, red) = runs[None], runs[4]
    assert losses4 == losses  # a quarter of the gradient on each of 4 equal ranks, summed: the same step
    np.testing.assert_array_equal(w4, w)
    np.testing.assert_array_equal(b4, b)
    n = w.size + b.size
    from polyamp.distributed._fingerprint import BITS

    assert red.sent[0] == ("sum", (1,), "int64")  # the sizes and configs checked, once
    assert red.sent[1:] == [("sum", (n + BITS.size,), "float32")] * 4  # the flat buffer + fingerprint


def test_reducer_is_checked_when_the_trainer_is_built():
    model = Linear(4, 2)
    with pytest.raises(TypeError, match="cannot build a reducer from"):
        MixedPrecisionTrainer(model, SGD(model.parameters()), reducer=[1, 2])


def test_the_device_side_fingerprint_path_trains_the_same(monkeypatch, twins):
    """The trainer's GPU-side path (the fingerprint built and checked on the device, forced here on
    NumPy arrays) takes the same steps as the host path."""
    import polyamp._agreement as agreement

    x, y = _data()
    runs = []
    for device_side in (False, True):
        if device_side:
            monkeypatch.setattr(agreement, "_on_host", lambda *args: False)
        model = Linear(4, 2)
        trainer = MixedPrecisionTrainer(model, SGD(model.parameters(), lr=0.1), "float16",
                                        LossScaleConfig(init_scale=2.0**10), max_grad_norm=1.0,
                                        reducer=twins(4))
        losses = [trainer.train_step(x, y, mse()).loss for _ in range(4)]
        runs.append((losses, model.w.data.copy(), trainer.skipped_steps))
    assert runs[0][0] == runs[1][0] and runs[0][2] == runs[1][2] == 0
    np.testing.assert_array_equal(runs[0][1], runs[1][1])


@pytest.mark.parametrize("loss", [np.array([[0.5]], np.float32), np.complex64(1 + 1j), np.array("a")],
                         ids=["one-value-2d", "complex", "str"])
def test_a_loss_is_read_before_anything_moves(loss):
    """Issue 32 item 11: a 1-element loss that is not 0-d is read as its value; one that is not a
    real value is refused before the weights move (it used to apply the step, then raise)."""
    model = Linear(4, 1)
    trainer = MixedPrecisionTrainer(model, SGD(model.parameters(), lr=0.1), "float16")
    before = model.w.data.copy()

    def loss_fn(output, target):
        return loss, np.ones_like(output, dtype=np.float32)

    if np.asarray(loss).dtype.kind == "f":
        metrics = trainer.train_step(np.ones((8, 4), np.float32), None, loss_fn)
        assert metrics.loss == 0.5 and trainer.steps == 1
    else:
        with pytest.raises(TypeError, match="loss"):
            trainer.train_step(np.ones((8, 4), np.float32), None, loss_fn)
        np.testing.assert_array_equal(model.w.data, before)
        assert trainer.steps == 0


@pytest.mark.parametrize("bad", [True, __import__("decimal").Decimal(1), 10**400],
                         ids=["bool", "decimal", "huge"])
def test_a_guarded_trainer_stays_usable_after_a_refused_loss(bad):
    """Issue 32 item 10: with a StepGuard, a refused loss used to leave the scaler's iteration open,
    so every later train_step raised ScalerStateError."""
    from polyamp import StepGuard

    model = Linear(4, 1)
    trainer = MixedPrecisionTrainer(model, SGD(model.parameters(), lr=0.1), "float16",
                                    LossScaleConfig(init_scale=1.0), guard=StepGuard(loss_zscore=3.0))
    x, y = np.ones((8, 4), np.float32), np.zeros((8, 1), np.float32)
    before = model.w.data.copy()
    with pytest.raises(TypeError, match="loss"):
        trainer.train_step(x, y, lambda o, t: (bad, mse()(o, t)[1]))
    np.testing.assert_array_equal(model.w.data, before)
    metrics = trainer.train_step(x, y, mse())  # usable: no ScalerStateError
    assert not metrics.skipped and trainer.steps == 1
